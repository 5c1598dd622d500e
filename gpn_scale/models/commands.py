"""`gpn-scale info`: what a model config costs before anything runs, for every registered
family: the family's own rows (`FamilySpec.info`), else what every spec can say."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpn_scale.models.protocol import FamilySpec


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "info",
        help="parameters, memory cells, FLOPs/token and memory of a model config",
        description="Print a model config's parameter count, memory cells, FLOPs per "
        "token and a training-memory estimate for a batch shape.",
    )
    p.add_argument("config", help="a name under configs/model (e.g. gpn_m_130m) or a YAML path")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per device (default 8)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per window (default 2048)")
    p.set_defaults(func=_info)


def _info(args: argparse.Namespace) -> int:
    from gpn_scale.core.config import ConfigError
    from gpn_scale.models.registry import load_model_config

    if args.batch_size < 1 or args.seq_len < 1:
        raise ConfigError("--batch-size and --seq-len must be >= 1")
    model, overrides = _model_of_training_config(args.config)
    spec, cfg = load_model_config(model, overrides or None)
    name = cfg.name or args.config
    if spec.info is not None:
        return _print_rows(spec.info(cfg, name, args.batch_size, args.seq_len))
    return _print_rows(info_rows(spec, cfg, name, args.seq_len))


def _model_of_training_config(name: str) -> tuple[str, dict]:
    """`info` on a training config (a YAML path, or a configs/train name that is no model's)
    describes the model it trains, saying so on stderr; anything else is passed through."""
    import sys
    from pathlib import Path

    from gpn_scale.core.config import read_yaml
    from gpn_scale.models.registry import CONFIG_DIR, training_config_model

    path = Path(name)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = CONFIG_DIR.parent / "train" / f"{name}.yaml"  # configs/train, beside configs/model
        if (CONFIG_DIR / f"{name}.yaml").is_file() or not path.is_file():
            return name, {}
    raw = read_yaml(path, what="config")
    named = training_config_model(raw) if isinstance(raw, dict) else None
    if named is None:
        return name, {}
    model, overrides = named
    print(
        f"{name} is a training config; showing its model, {model}"
        + (f", with model_overrides {overrides}" if overrides else ""),
        file=sys.stderr,
    )
    return model, overrides


def info_rows(spec: FamilySpec, cfg: Any, name: str, seq_len: int) -> list[tuple[str, str]]:
    """What any registered family's spec can say (a spec without its own `info`)."""
    shape = {k: v for k, v in spec.compat_keys(cfg).items() if k != "family"}
    return [
        ("model", f"{name} ({spec.name}, {cfg.n_layers} layer(s))"),
        ("shape", " ".join(f"{k}={v}" for k, v in shape.items())),
        ("parameters", f"{spec.count_parameters(cfg):,}"),
        (f"training FLOPs/token (T={seq_len})", f"{spec.flops_per_token(cfg, seq_len):.4g}"),
        ("state", "recurrent (fixed size)" if spec.recurrent else "grows with the context"),
    ]


def _print_rows(rows: list[tuple[str, str]]) -> int:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
