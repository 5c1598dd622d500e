"""The model a run trains: its `model` config with `model_overrides`, `train.tbptt` and the
`engine:` section applied (the last two through the family's `run_options`), each error named
by the run's own key (`model_overrides.d_state`, `engine.chunk_size`). Read by the trainer's
preflight and by evaluation (a run folder's `model_final.pt`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpn_scale.core.config import ConfigError
from gpn_scale.run.config import TrainConfig

if TYPE_CHECKING:
    from gpn_scale.models.protocol import FamilySpec


def model_config(cfg: TrainConfig) -> Any:
    """The run's model config (any registered family, models/registry.py): `cfg.model` +
    `model_overrides` (+ `train.tbptt` when set, which the schema already checked, and the
    `engine:` options it sets, each through the family's `run_options`); an invalid value
    fails naming the key it came from, and a family-specific training option another family
    cannot honour fails naming that option and the families that take it."""
    from gpn_scale.models.registry import load_model_config

    overrides = dict(cfg.model_overrides)
    try:
        spec, model_cfg = load_model_config(cfg.model, overrides=overrides or None)
    except ConfigError as err:
        msg = str(err)
        field, sep, rest = msg.partition(": ")
        field = field.removeprefix("model.")
        if sep and field in cfg.model_overrides:
            raise ConfigError(f"model_overrides.{field}: {rest}") from None
        if cfg.model_overrides:  # a field of the model file that the overrides made invalid
            raise ConfigError(
                f"model={cfg.model} with model_overrides {dict(cfg.model_overrides)}: {msg}"
            ) from None
        raise
    if cfg.train.tbptt is not None:
        model_cfg = _run_option(cfg, spec, model_cfg, "tbptt", cfg.train.tbptt, "train.tbptt")
    given = cfg.engine.given()
    if given:
        key = f"engine.{next(iter(given))}"
        model_cfg = _run_option(cfg, spec, model_cfg, "engine", given, key)
    check_compile(cfg, spec)
    if cfg.train.stateful_windows and not spec.recurrent:
        raise ConfigError(
            f"train.stateful_windows: model={cfg.model} is family {spec.name}, whose state "
            "(a KV cache) grows with every window instead of carrying a fixed-size one; set "
            "train.stateful_windows=false"
        )
    return model_cfg


# The family-specific run options (FamilySpec.run_options): what the line refusing one says
# before and after "model=... is family X" ({takers}: the families that take it).
_REFUSALS = {
    "tbptt": (
        "truncated BPTT is a {takers} option",
        ", which has no recurrence to truncate; remove train.tbptt",
    ),
    "engine": ("the engine options are {takers}'s", "; remove the engine section"),
}


def _run_option(
    cfg: TrainConfig, spec: FamilySpec, model_cfg: Any, option: str, value: Any, key: str
) -> Any:
    """The model config with a family-specific run option applied (`spec.run_options`), or
    one line naming `key` and the families that take it when this family does not."""
    from gpn_scale.models.registry import titles_where

    apply = spec.run_options.get(option)
    if apply is not None:
        return apply(model_cfg, value)
    what, tail = _REFUSALS[option]
    raise ConfigError(
        f"{key}: {what.format(takers=titles_where(lambda s: option in s.run_options))}; "
        f"model={cfg.model} is family "
        f"{spec.name}{tail}"
    )


def check_compile(cfg: TrainConfig, spec: FamilySpec) -> None:
    """`compile.enable=true` for a family that declares no blocks to compile (GPN / GPN+M)
    is refused in one line: the family's reason (`spec.not_compiled`) and the families that
    take it. Refused rather than accepted and ignored: a sweep sets the key per model entry
    (`overrides: [compile.enable=true]` on the baselines' entries), so a mixed sweep never
    has to give it to GPN."""
    if not cfg.compile.enable or spec.compile_blocks is not None:
        return
    from gpn_scale.models.registry import families_where

    takers = [s.name for s in families_where(lambda s: s.compile_blocks is not None)]
    raise ConfigError(
        f"compile.enable: model={cfg.model} is family {spec.name}, {spec.not_compiled}; "
        f"compile.enable is for {', '.join(takers)}; "
        "set compile.enable=false (in a sweep, set it on those families' entries only)"
    )
