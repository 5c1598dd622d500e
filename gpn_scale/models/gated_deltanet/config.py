"""Gated DeltaNet's configuration: one validated, frozen dataclass, loadable from YAML.

Names follow the GDN paper's layer (Yang et al., "Gated Delta Networks"): d = d_model,
L = n_layers, per layer H = n_heads heads with keys of d_key and values of d_value (fla's
`head_dim` and `head_dim * expand_v`), f = d_ffn for the SwiGLU MLP, short causal depthwise
convolutions of `conv_size` taps on q, k and v.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from gpn_scale.core.config import ConfigError, check_fields, closest_key_hint

BACKENDS = ("auto", "chunk", "recurrent", "fla")
# The fields a checkpoint must share with the config that resumes it (the model's shape).
SHAPE_KEYS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "d_key",
    "d_value",
    "d_ffn",
    "conv_size",
)


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """GDN hyper-parameters plus how the recurrence is computed (never what it computes).

    `backend` picks the gated-delta-rule kernel (gpn_scale/ops/gated_delta_rule.py): auto =
    fla's chunk kernel on CUDA when fla imports, else our chunkwise op; chunk = ours;
    recurrent = ours, step by step (the spec; slow); fla = fla's kernel (CUDA only). The
    environment variable GPN_SCALE_GDN_BACKEND overrides it.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_key: int
    d_value: int
    d_ffn: int
    conv_size: int = 4
    norm_eps: float = 1e-6
    # fla's GatedDeltaNetForCausalLM init: N(0, init_std) for linear, conv and embedding
    # weights; o_proj and the MLP's down projection divided by sqrt(2 * n_layers).
    init_std: float = 0.02
    rescale_prenorm_residual: bool = True
    # Chunk length of our chunkwise op (fla's kernel uses its own, 64).
    chunk_size: int = 64
    backend: str = "auto"
    # The head's cross-entropy runs over this many positions at a time, its gradients formed
    # in the same pass (models/linear_cross_entropy.py), never the B*T x V logits at once;
    # how the loss is computed, never what (GPN's engine.loss_chunk_tokens).
    loss_chunk_tokens: int = 1024
    # Optional redundant check: when given, must equal n_layers * n_heads * d_key * d_value.
    memory_cells: int | None = None
    name: str = ""
    family_name: ClassVar[str] = "gated_deltanet"

    def __post_init__(self) -> None:
        for key in (*SHAPE_KEYS, "chunk_size", "loss_chunk_tokens"):
            _require_int(key, getattr(self, key), minimum=1)
        for key in ("norm_eps", "init_std"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{key}: expected a positive number, got {value!r}")
        if not isinstance(self.rescale_prenorm_residual, bool):
            raise ConfigError(
                f"rescale_prenorm_residual: expected true or false, got "
                f"{self.rescale_prenorm_residual!r}"
            )
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"backend: expected one of {', '.join(BACKENDS)}, got {self.backend!r}"
                f"{closest_key_hint(str(self.backend), BACKENDS)}"
            )
        if self.memory_cells is not None and self.memory_cells != self.cells:
            raise ConfigError(
                f"memory_cells: {self.memory_cells} does not match n_layers*n_heads*d_key*d_value"
                f" = {self.n_layers}*{self.n_heads}*{self.d_key}*{self.d_value} = {self.cells}; "
                "fix the heads or widths, or drop memory_cells (set it to null)"
            )

    @property
    def cells(self) -> int:
        """Memory cells per sequence, all layers: L * H * dk * dv."""
        return self.n_layers * self.n_heads * self.d_key * self.d_value

    @property
    def family(self) -> str:
        """The variant label fits and reports use (GPNConfig.family's counterpart)."""
        return self.family_name

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family_name, **dataclasses.asdict(self)}

    def replace(self, **changes: Any) -> GatedDeltaNetConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> GatedDeltaNetConfig:
        """Build from a mapping; an unknown key fails naming the closest valid one."""
        values = {
            str(k): v for k, v in values.items() if not (k == "family" and v == cls.family_name)
        }
        check_fields(cls, values)
        return cls(**values)


def _require_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value}")
