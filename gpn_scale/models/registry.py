"""The family registry: a model YAML's `family:` key names the FamilySpec that builds it.

Families load on first use (importing the registry imports no model code), so the CLI, sweeps
and fits can resolve a family from a config without importing torch-heavy modules they do not
need. A YAML without `family:` is GPN / GPN+M (every config written before the registry).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from gpn_scale.core.config import (
    ConfigError,
    check_float_fields,
    closest_key_hint,
    read_yaml,
    resolve_named_yaml,
)
from gpn_scale.models.protocol import FamilySpec

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"
DEFAULT_FAMILY = "gpn"

# name -> the module exposing its `SPEC: FamilySpec`: one line per family, models/<name>/spec.py
_FAMILY_MODULES: dict[str, str] = {
    "gpn": "gpn_scale.models.gpn.spec",
    "transformer_pp": "gpn_scale.models.transformer_pp.spec",
    "gated_deltanet": "gpn_scale.models.gated_deltanet.spec",
}
# Families registered at run time (a family outside the package, a test's): name -> spec.
_REGISTERED: dict[str, FamilySpec] = {}


def family_names() -> tuple[str, ...]:
    return (*_FAMILY_MODULES, *_REGISTERED)


def get_family(name: str) -> FamilySpec:
    """The spec of a registered family; an unknown name is one ConfigError line."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _FAMILY_MODULES:
        raise ConfigError(
            f"model.family: unknown family {name!r}{closest_key_hint(name, family_names())}; "
            f"expected one of {', '.join(family_names())}"
        )
    spec = importlib.import_module(_FAMILY_MODULES[name]).SPEC
    assert isinstance(spec, FamilySpec) and spec.name == name, _FAMILY_MODULES[name]
    return spec


def families_where(has: Callable[[FamilySpec], object]) -> list[FamilySpec]:
    """The registered families whose spec satisfies `has`, in registration order (what the
    line refusing an option names, instead of a family named in the caller)."""
    return [spec for spec in map(get_family, family_names()) if has(spec)]


def titles_where(has: Callable[[FamilySpec], object]) -> str:
    """Their titles, "GPN / Transformer++"."""
    return " / ".join(spec.display_name for spec in families_where(has))


def register(spec: FamilySpec) -> None:
    """Make `spec` a family of this process (configs name it with `family: <spec.name>`),
    for a family that lives outside gpn_scale/models; a shipped family adds its line to
    `_FAMILY_MODULES` instead. A name already taken is refused."""
    if not isinstance(spec, FamilySpec):
        raise TypeError(f"register: expected a FamilySpec, got {type(spec).__name__}")
    if spec.name in family_names():
        raise ValueError(f"register: family {spec.name!r} is already registered")
    _REGISTERED[spec.name] = spec


def unregister(name: str) -> None:
    """Forget a family `register` added (a shipped family stays)."""
    _REGISTERED.pop(name, None)


@contextlib.contextmanager
def registered(spec: FamilySpec) -> Iterator[FamilySpec]:
    """`spec` registered for the duration of the block, removed again on the way out."""
    register(spec)
    try:
        yield spec
    finally:
        unregister(spec.name)


def split_family(values: Mapping[str, Any]) -> tuple[FamilySpec, dict[str, Any]]:
    """(spec, the remaining fields) of a model mapping whose optional `family` key names it."""
    fields = {str(k): v for k, v in values.items()}
    name = fields.pop("family", DEFAULT_FAMILY)
    if not isinstance(name, str):
        raise ConfigError(f"model.family: expected a family name, got {name!r}")
    return get_family(name), fields


def config_from_dict(values: Mapping[str, Any]) -> tuple[FamilySpec, Any]:
    """(spec, validated config) from a model mapping (a checkpoint's saved config, a sweep's)."""
    spec, fields = split_family(values)
    cfg = spec.config_from_dict(fields)
    check_float_fields(cfg)  # nan / inf / negative epsilons and scales, for every family
    return spec, cfg


def load_model_config(
    name_or_path: str | Path, overrides: Mapping[str, Any] | None = None
) -> tuple[FamilySpec, Any]:
    """`configs/model/<name>.yaml` (or any YAML path) -> (family spec, validated config).

    The YAML may hold the fields at top level or under a `model:` key; `name` defaults to the
    file's stem.
    """
    path = resolve_named_yaml(name_or_path, CONFIG_DIR, "model config")
    raw = read_yaml(path, what="model config")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of model fields")
    if "model" in raw and isinstance(raw["model"], dict):
        raw = raw["model"]
    named = training_config_model(raw)
    if named is not None:
        raise ConfigError(
            f"{path}: this is a training config (model: {named[0]}), not a model config; "
            f"pass its model, {named[0]}, or train it with `gpn-scale train {path}`"
        )
    raw.setdefault("name", Path(path).stem)
    if overrides:
        raw.update(overrides)
    return config_from_dict(raw)


# Top-level sections of a training config (gpn_scale/run/config.py) that no model has.
_TRAINING_SECTIONS = frozenset(
    {"data", "optim", "schedule", "train", "parallel", "checkpoint", "logging", "eval"}
)


def training_config_model(raw: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(model, model_overrides) when the mapping read from a YAML is a training config (a
    `model:` name beside training sections), else None."""
    model = raw.get("model")
    if isinstance(model, str) and _TRAINING_SECTIONS & set(raw):
        overrides = raw.get("model_overrides")
        return model, dict(overrides) if isinstance(overrides, Mapping) else {}
    return None


def family_of(config: Any) -> FamilySpec:
    """The spec of a built config (each family's config has a `family_name` attribute)."""
    return get_family(getattr(config, "family_name", DEFAULT_FAMILY))


def shape_differences(spec: FamilySpec, saved: Mapping[str, Any], config: Any) -> list[str]:
    """'key saved != current' for each shape key (the family's `compat_keys`) where a saved
    model config differs from `config`: what makes a checkpoint unloadable into it."""
    keys = {k: v for k, v in spec.compat_keys(config).items() if k != "family"}
    return [f"{k} {saved.get(k)} != {v}" for k, v in keys.items() if saved.get(k) != v]
