"""The model's configuration: one validated dataclass, loadable from OmegaConf YAML.

Every field is named after the spec's symbol (`../shared/spec/gpn-model.md`):
V=vocab_size, d=d_state, e=d_emb, f=d_ffn, L=n_layers, H=n_heads, dk=d_key, dv=d_value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from gpn_scale.core.config import (  # noqa: F401  (re-exported: the model's own error type)
    ConfigError,
    check_fields,
    closest_key_hint,
    resolve_named_yaml,
)
from gpn_scale.models.registry import load_model_config as load_any_model_config
from gpn_scale.ops.gpn_step.options import EngineOptions

ENGINE_FIELDS = EngineOptions.field_names()


@dataclass(frozen=True)
class GPNConfig:
    """GPN / GPN+M hyper-parameters, plus the engine's execution options under `engine`.

    `memory=False` gives the memory-less GPN; the memory fields must then stay 0.
    `engine` changes how the sequence is computed, never what it computes (but for
    `bf16_memory_reads`, off by default: ops/gpn_step/options.py); `tbptt` > 0 stops
    gradients through the carry every `tbptt` steps. A mapping (a model YAML, a checkpoint's
    config) may spell the engine options flat (`chunk_size: 64`, as the model YAMLs and the
    checkpoints written before `engine` existed do) or as an `engine:` section.
    """

    vocab_size: int
    d_state: int
    d_emb: int
    d_ffn: int
    n_layers: int = 1
    memory: bool = True
    n_heads: int = 0
    d_key: int = 0
    d_value: int = 0
    decoder_bias: bool = False
    # Truncated BPTT: detach the carried state every `tbptt` steps (0 = full BPTT).
    tbptt: int = 0
    # How the engine runs the sequence (chunk length, loss chunk, step backend, CUDA graphs):
    # never what it computes (bf16_memory_reads aside), so not part of the shape
    # (ops/gpn_step/options.py).
    engine: EngineOptions = field(default_factory=EngineOptions)
    # Optional redundant check: when given, must equal n_heads * d_key * d_value.
    memory_cells: int | None = None
    name: str = ""
    norm_eps: float = field(default=1e-6, repr=False)
    # The registry name (gpn_scale/models/registry.py); `family` below is the variant label.
    family_name: ClassVar[str] = "gpn"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "d_state",
            "d_emb",
            "d_ffn",
            "n_layers",
        ):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("tbptt", self.tbptt, minimum=0)
        if not isinstance(self.memory, bool):
            raise ConfigError(f"memory: expected true or false, got {self.memory!r}")
        if not isinstance(self.engine, EngineOptions):
            raise ConfigError(f"engine: expected the engine options, got {self.engine!r}")
        if not isinstance(self.decoder_bias, bool):
            raise ConfigError(f"decoder_bias: expected true or false, got {self.decoder_bias!r}")
        if self.memory:
            for name in ("n_heads", "d_key", "d_value"):
                _require_int(
                    name,
                    getattr(self, name),
                    minimum=1,
                    why=" (GPN+M needs a memory; set memory: false for GPN)",
                )
            if self.memory_cells is not None and self.memory_cells != self.cells:
                raise ConfigError(
                    f"memory_cells: {self.memory_cells} does not match n_heads*d_key*d_value = "
                    f"{self.n_heads}*{self.d_key}*{self.d_value} = {self.cells}; fix the heads or "
                    "widths, or drop memory_cells (set it to null)"
                )
        else:
            for name in ("n_heads", "d_key", "d_value"):
                _require_int(name, getattr(self, name), minimum=0)
                if getattr(self, name) != 0:
                    raise ConfigError(
                        f"{name}: must be 0 when memory is false (GPN has no memory); "
                        "set memory: true for GPN+M"
                    )
            if self.memory_cells not in (None, 0):
                raise ConfigError("memory_cells: must be 0 when memory is false")

    @property
    def cells(self) -> int:
        """Memory cells per sequence: H * dk * dv (0 for GPN)."""
        return self.n_heads * self.d_key * self.d_value if self.memory else 0

    @property
    def family(self) -> str:
        return "gpn+m" if self.memory else "gpn"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> GPNConfig:
        """A copy with `changes`; an engine option may be named by itself (`chunk_size=8`)."""
        engine = {k: changes.pop(k) for k in ENGINE_FIELDS if k in changes}
        if engine:
            changes["engine"] = changes.get("engine", self.engine).replace(**engine)
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> GPNConfig:
        """Build from a mapping; an unknown key fails naming the closest valid one."""
        values = {k: v for k, v in values.items() if not (k == "family" and v == cls.family_name)}
        if "family" in values:  # another family's config met by a GPN-only reader
            raise ConfigError(
                f"model.family: {values['family']!r} is not GPN; this reads GPN / GPN+M configs "
                "only (the trainer, info and sweeps read every family)"
            )
        values = dict(values)
        engine = _engine_from(values)
        check_fields(cls, values)
        return cls(**values, engine=engine)


def _engine_from(values: dict[str, Any]) -> EngineOptions:
    """Take the engine options out of a config mapping (flat keys and/or an `engine:`
    section; the same option given both ways with two values is one line)."""
    section = values.pop("engine", None) or {}
    EngineOptions.check_keys(section, prefix="model.engine.")
    flat = {k: values.pop(k) for k in ENGINE_FIELDS if k in values}
    for key in flat.keys() & section.keys():
        if flat[key] != section[key]:
            raise ConfigError(
                f"model.{key}: {flat[key]!r} and model.engine.{key}: {section[key]!r} disagree; "
                "set the option once"
            )
    return EngineOptions.from_dict({**section, **flat}, prefix="")


def _require_int(name: str, value: Any, minimum: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value}{why}")


def load_model_config(
    name_or_path: str | Path, overrides: Mapping[str, Any] | None = None
) -> GPNConfig:
    """A GPN / GPN+M config through the one model-config loader (`models/registry.py`), for the
    tools that run GPN only (benchmarks, the GPU accounting); another family's YAML is one
    ConfigError line."""
    spec, cfg = load_any_model_config(name_or_path, overrides)
    if not isinstance(cfg, GPNConfig):
        GPNConfig.from_dict({"family": spec.name})  # the one line naming the family
    return cfg
