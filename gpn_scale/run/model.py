"""The model a run trains: its `model` config with `model_overrides`, `train.tbptt` and the
`engine:` section applied, each error named by the run's own key (`model_overrides.d_state`,
`engine.chunk_size`). Read by the trainer's preflight and by evaluation (a run folder's
`model_final.pt`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpn_scale.core.config import ConfigError
from gpn_scale.run.config import TrainConfig

if TYPE_CHECKING:
    from gpn_scale.models.protocol import FamilySpec


def model_config(cfg: TrainConfig) -> Any:
    """The run's model config (any registered family, models/registry.py): `cfg.model` +
    `model_overrides` (+ `train.tbptt` when set, which the schema already checked, and the
    `engine:` options it sets); an invalid
    value fails naming the key it came from, and a GPN-only training option another family
    cannot honour fails naming that option."""
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
        if spec.name != "gpn":
            raise ConfigError(
                f"train.tbptt: truncated BPTT is a GPN option; model={cfg.model} is family "
                f"{spec.name}, which has no recurrence to truncate; remove train.tbptt"
            )
        model_cfg = model_cfg.replace(tbptt=cfg.train.tbptt)
    model_cfg = _with_engine(cfg, spec.name, model_cfg)
    check_compile(cfg, spec)
    if cfg.train.stateful_windows and not spec.recurrent:
        raise ConfigError(
            f"train.stateful_windows: model={cfg.model} is family {spec.name}, whose state "
            "(a KV cache) grows with every window instead of carrying a fixed-size one; set "
            "train.stateful_windows=false"
        )
    return model_cfg


def _with_engine(cfg: TrainConfig, family: str, model_cfg: Any) -> Any:
    """The model config with the run's `engine:` options over the model file's."""
    given = cfg.engine.given()
    if not given:
        return model_cfg
    key = f"engine.{next(iter(given))}"
    if family != "gpn":
        raise ConfigError(
            f"{key}: the engine options are GPN's; model={cfg.model} is family {family}; "
            "remove the engine section"
        )
    from gpn_scale.ops.gpn_step.options import EngineOptions

    options = EngineOptions.from_dict({**model_cfg.engine.to_dict(), **given}, prefix="engine.")
    return model_cfg.replace(engine=options)


def check_compile(cfg: TrainConfig, spec: FamilySpec) -> None:
    """`compile.enable=true` for a family that declares no blocks to compile (GPN / GPN+M)
    is refused in one line naming the families that take it. Refused rather than accepted
    and ignored: a sweep sets the key per model entry (`overrides: [compile.enable=true]`
    on the baselines' entries), so a mixed sweep never has to give it to GPN."""
    if not cfg.compile.enable or spec.compile_blocks is not None:
        return
    from gpn_scale.models.registry import family_names, get_family

    takers = [n for n in family_names() if get_family(n).compile_blocks is not None]
    raise ConfigError(
        f"compile.enable: model={cfg.model} is family {spec.name}, whose sequence engine runs "
        f"its own kernels and is not compiled; compile.enable is for {', '.join(takers)}; "
        "set compile.enable=false (in a sweep, set it on those families' entries only)"
    )
