"""`gpn-scale info`: what a model config costs before anything runs."""

from __future__ import annotations

import argparse


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
    from gpn_scale.models.gpn.config import ConfigError
    from gpn_scale.models.gpn.counts import (
        count_parameters,
        estimate_training_memory,
        flops_per_token,
        forward_flops_per_token,
        non_embedding_parameters,
    )
    from gpn_scale.models.registry import load_model_config as load_any

    if args.batch_size < 1 or args.seq_len < 1:
        raise ConfigError("--batch-size and --seq-len must be >= 1")
    model, overrides = _model_of_training_config(args.config)
    spec, cfg = load_any(model, overrides or None)
    if spec.name != "gpn":
        return _print_rows(_family_rows(spec, cfg, args))
    mem = estimate_training_memory(cfg, args.batch_size, args.seq_len)
    gib = 1024**3
    rows = [
        ("model", f"{cfg.name or args.config} ({cfg.family}, {cfg.n_layers} layer(s))"),
        (
            "shape",
            f"V={cfg.vocab_size} d={cfg.d_state} e={cfg.d_emb} f={cfg.d_ffn}"
            + (f" H={cfg.n_heads} dk={cfg.d_key} dv={cfg.d_value}" if cfg.memory else ""),
        ),
        ("parameters", f"{count_parameters(cfg):,}"),
        ("non-embedding parameters", f"{non_embedding_parameters(cfg):,}"),
        ("memory cells", f"{cfg.cells:,}"),
        ("forward FLOPs/token", f"{forward_flops_per_token(cfg):.4g}"),
        ("training FLOPs/token", f"{flops_per_token(cfg, args.seq_len):.4g}"),
        (
            f"training memory (B={args.batch_size}, T={args.seq_len}, fp32 + AdamW)",
            f"{mem.total_bytes / gib:.2f} GiB = weights {mem.parameters_bytes / gib:.2f} "
            "+ grads/AdamW "
            f"{mem.training_state_bytes / gib:.2f} + activations {mem.activations_bytes / gib:.2f}",
        ),
    ]
    return _print_rows(rows)


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


def _family_rows(spec, cfg, args: argparse.Namespace) -> list[tuple[str, str]]:
    """What any registered family's spec can say (models/protocol.py FamilySpec)."""
    shape = {k: v for k, v in spec.compat_keys(cfg).items() if k != "family"}
    return [
        ("model", f"{cfg.name or args.config} ({spec.name}, {cfg.n_layers} layer(s))"),
        ("shape", " ".join(f"{k}={v}" for k, v in shape.items())),
        ("parameters", f"{spec.count_parameters(cfg):,}"),
        (
            f"training FLOPs/token (T={args.seq_len})",
            f"{spec.flops_per_token(cfg, args.seq_len):.4g}",
        ),
        ("state", "recurrent (fixed size)" if spec.recurrent else "grows with the context"),
    ]


def _print_rows(rows: list[tuple[str, str]]) -> int:
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0
