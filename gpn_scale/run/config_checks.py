"""The checks of a training config: `check_keys` (every key the schema defines, else one
line naming the closest), `check_numbers` (the one rule for numbers: finite, never negative)
and `validate` (the value checks the types cannot express), each failure one ConfigError line.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from gpn_scale.core.config import ConfigError, closest_key_hint
from gpn_scale.run.config_schema import (
    SECTION_TYPES,
    EngineSection,
    ProfilingSection,
    TrainConfig,
    all_keys,
)

# One rule for every number of the schema: finite, never negative. Where 0 means "off" (or
# "none"), the message says so; any other lower bound is checked in `validate`.
ZERO_IS_OFF = {
    "checkpoint.every_steps": "0 = only on preemption and at the end",
    "checkpoint.lease_ttl_s": "0 = no lease",
    "eval.every_steps": "0 = only at the end",
    "analysis.every_steps": "0 = off",
    "preemption.end_margin_s": "0 = off",
    "optim.grad_clip": "0 = no clipping",
    "optim.weight_decay": "0 = no decay",
    "train.tbptt": "0 = full BPTT",
    "debug.step_sleep": "0 = off",
    "debug.eval_sleep": "0 = off",
    "debug.setup_sleep": "0 = off",
    "profiling.warmup": "0 = no warm-up steps",
}

ASYNC_MODES = ("off", "async", "async_with_pinned_mem")
_ENUMS = {
    "train.device": ("auto", "cpu", "cuda"),
    "train.precision": ("auto", "fp32", "bf16"),
    "parallel.backend": ("auto", "none", "fsdp2", "deepspeed"),
    "parallel.reduce_dtype": ("fp32", "bf16"),
    "logging.wandb.mode": ("online", "offline", "auto", "disabled"),
    "checkpoint.async_mode": ASYNC_MODES,
}
# Keys whose value is a free mapping (validated elsewhere: model_overrides by GPNConfig).
_FREE_MAPPINGS = {"model_overrides"}


def check_keys(values: Any, schema: type, prefix: str = "") -> None:
    """Raise ConfigError (one line, closest key) for any key the schema does not define."""
    if not isinstance(values, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            hint = closest_key_hint(str(key), [f"{prefix}{k}" for k in fields])
            if not hint:  # also try the whole schema (a key under the wrong section)
                hint = closest_key_hint(dotted, all_keys())
            raise ConfigError(f"{dotted}: unknown config key{hint}")
        if dotted in _FREE_MAPPINGS:
            continue
        ftype = fields[key].type
        sub = SECTION_TYPES.get(ftype if isinstance(ftype, str) else getattr(ftype, "__name__", ""))
        if sub is not None:
            if not isinstance(value, dict):
                raise ConfigError(f"{dotted}: expected a section of keys, got {value!r}")
            check_keys(value, sub, prefix=f"{dotted}.")


def _numbers(obj: Any, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted key, value) of every number in the config (lists included; bools are not
    numbers; model_overrides is the model config's to check)."""
    out: list[tuple[str, float]] = []
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if key in _FREE_MAPPINGS:
            continue
        if dataclasses.is_dataclass(value):
            out += _numbers(value, f"{key}.")
        elif isinstance(value, (list, tuple)):
            out += [
                (f"{key}[{i}]", v)
                for i, v in enumerate(value)
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            ]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append((key, value))
    return out


def check_numbers(cfg: TrainConfig) -> None:
    """Every number finite and >= 0 (the one rule; docs/training.md): `optim.lr=nan` or
    `checkpoint.every_steps=-1` is refused in one line naming the key, never read as "off"."""
    for key, value in _numbers(cfg):
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
        if value < 0:
            off = ZERO_IS_OFF.get(key)
            raise ConfigError(
                f"{key}: must be >= 0{f' ({off})' if off else ''}, got {value}; negative "
                "numbers are never read as off"
            )


def _check_engine(section: EngineSection) -> None:
    """Each option the run sets, checked as the engine checks it, named engine.<key>."""
    if section.given():
        from gpn_scale.ops.gpn_step.options import EngineOptions

        EngineOptions.from_dict(section.given(), prefix="engine.")


def _check_parallel_and_analysis(cfg: TrainConfig) -> None:
    """parallel.* values, and the live analyses, which need the whole model on one rank."""
    if cfg.parallel.zero_stage not in (1, 2, 3):
        raise ConfigError(f"parallel.zero_stage: expected 1, 2 or 3, got {cfg.parallel.zero_stage}")
    if isinstance(cfg.parallel.tp, bool) or not isinstance(cfg.parallel.tp, int):
        raise ConfigError(f"parallel.tp: expected an integer, got {cfg.parallel.tp!r}")
    if cfg.parallel.tp < 1:
        raise ConfigError(f"parallel.tp: must be >= 1, got {cfg.parallel.tp}")
    if cfg.parallel.tp > 1 and cfg.parallel.backend in ("none", "deepspeed"):
        raise ConfigError(
            f"parallel.tp={cfg.parallel.tp}: tensor parallelism runs under "
            f"parallel.backend=fsdp2 (or auto), not {cfg.parallel.backend}; use fsdp2"
        )
    if cfg.checkpoint.async_mode != "off" and cfg.parallel.backend == "deepspeed":
        # DeepSpeed's engine.save_checkpoint writes its own files from its own buffers: no
        # staged copy of them to write from a background thread while training goes on.
        raise ConfigError(
            f"checkpoint.async_mode={cfg.checkpoint.async_mode}: background saves are for "
            "parallel.backend none / fsdp2 (DCP), not deepspeed; set checkpoint.async_mode=off"
        )
    if cfg.compile.enable and cfg.parallel.backend == "deepspeed" and cfg.parallel.zero_stage == 3:
        # ZeRO-3 gathers each submodule's weights in forward hooks DeepSpeed marks
        # torch.compiler.disable: inside a compiled block they break the graph at every
        # Linear (Transformer++'s one-graph compile fails on the first).
        raise ConfigError(
            "compile.enable: ZeRO-3 (parallel.zero_stage=3) gathers every submodule's "
            "weights in hooks torch.compile cannot trace; use parallel.zero_stage 1 or 2, "
            "parallel.backend=fsdp2, or compile.enable=false"
        )
    if cfg.analysis.every_steps < 0:
        raise ConfigError(
            f"analysis.every_steps: must be >= 0 (0 = off), got {cfg.analysis.every_steps}"
        )
    if cfg.analysis.every_steps and cfg.parallel.tp > 1:
        raise ConfigError(
            f"analysis.every_steps: the live analyses run the whole model on one rank, which "
            f"parallel.tp={cfg.parallel.tp} splits; set analysis.every_steps=0 and run "
            "`gpn-scale analyze` on a checkpoint (it loads the full model), or train at tp=1"
        )
    if cfg.analysis.rows < 1 or cfg.analysis.tokens < 3:
        raise ConfigError(
            f"analysis.rows / analysis.tokens: need rows >= 1 and tokens >= 3, got "
            f"{cfg.analysis.rows} / {cfg.analysis.tokens}"
        )


def _check_profiling(section: ProfilingSection) -> None:
    """profiling.*: a schedule that fits its period and a folder the storage layer opens."""
    for key in ("every", "active"):
        if getattr(section, key) < 1:
            raise ConfigError(f"profiling.{key}: must be >= 1, got {getattr(section, key)}")
    if section.warmup + section.active > section.every:
        raise ConfigError(
            f"profiling.warmup + profiling.active: must be <= profiling.every={section.every} "
            f"(one window per period), got {section.warmup} + {section.active}; raise "
            "profiling.every or shorten the window"
        )
    folder = section.folder
    if folder is not None and not folder.strip():
        raise ConfigError(
            "profiling.folder: empty; give a directory or s3://bucket/prefix, or null "
            "(<run_dir>/profiling)"
        )
    if folder is not None and "://" in folder and not folder.startswith(("s3://", "file://")):
        raise ConfigError(
            f"profiling.folder: {folder!r} uses unsupported scheme "
            f"'{folder.split('://', 1)[0]}'; use a directory or s3://bucket/prefix"
        )


_SIZE = re.compile(r"\s*(\d+(\.\d+)?)\s*(b|[kmgtp]b)?\s*", re.IGNORECASE)


def _check_cache_limit(limit: str | None) -> None:
    """data.cache_limit: a size streaming reads (`500mb`, `20gb`, bytes), above zero."""
    if limit is None:
        return
    match = _SIZE.fullmatch(str(limit))
    bytes_with_fraction = match and match.group(2) and (match.group(3) or "b").lower() == "b"
    if not match or float(match.group(1)) <= 0 or bytes_with_fraction:
        raise ConfigError(
            f"data.cache_limit: expected a size such as 500mb, 20gb or a number of bytes, got "
            f"{limit!r}; or null for no limit"
        )


def validate(cfg: TrainConfig) -> None:
    """Value checks the types cannot express (one line each)."""
    check_numbers(cfg)
    _check_cache_limit(cfg.data.cache_limit)
    if cfg.checkpoint.async_mode == "False":  # YAML reads off (and false, no) as a boolean
        cfg.checkpoint.async_mode = "off"
    for key, allowed in _ENUMS.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if value not in allowed:
            raise ConfigError(
                f"{key}: expected one of {', '.join(allowed)}, got {value!r}"
                f"{closest_key_hint(str(value), allowed)}"
            )
    _check_engine(cfg.engine)
    if cfg.train.deterministic not in (True, False, "auto"):
        raise ConfigError(
            f"train.deterministic: expected auto, true or false, got {cfg.train.deterministic!r}"
        )
    positive = {
        "data.seq_len": cfg.data.seq_len,
        "train.global_batch_size": cfg.train.global_batch_size,
        "schedule.total_steps": cfg.schedule.total_steps,
        "train.log_every": cfg.train.log_every,
        "eval.batches": cfg.eval.batches,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
        "train.max_nonfinite_in_a_row": cfg.train.max_nonfinite_in_a_row,
    }
    for key, number in positive.items():
        if number < 1:
            raise ConfigError(f"{key}: must be >= 1, got {number}")
    if cfg.schedule.warmup_steps < 0 or cfg.schedule.warmup_steps > cfg.schedule.total_steps:
        raise ConfigError(
            f"schedule.warmup_steps: must be in [0, schedule.total_steps="
            f"{cfg.schedule.total_steps}], got {cfg.schedule.warmup_steps}"
        )
    if not 0.0 <= cfg.schedule.min_lr_ratio <= 1.0:
        raise ConfigError(
            f"schedule.min_lr_ratio: must be in [0, 1], got {cfg.schedule.min_lr_ratio}"
        )
    if cfg.logging.wandb.init_timeout <= 0:
        raise ConfigError(
            f"logging.wandb.init_timeout: seconds, must be > 0, got "
            f"{cfg.logging.wandb.init_timeout}"
        )
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr: must be > 0, got {cfg.optim.lr}")
    for key, beta in (("optim.beta1", cfg.optim.beta1), ("optim.beta2", cfg.optim.beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{key}: must be in [0, 1), got {beta}")
    if cfg.optim.eps <= 0:
        raise ConfigError(f"optim.eps: must be > 0, got {cfg.optim.eps}")
    _check_parallel_and_analysis(cfg)
    _check_profiling(cfg.profiling)
    mb = cfg.train.micro_batch_size
    if mb is not None and mb < 1:
        raise ConfigError(f"train.micro_batch_size: must be >= 1, got {mb}")
    if cfg.train.tbptt is not None and cfg.train.tbptt < 0:
        raise ConfigError(f"train.tbptt: must be >= 0, got {cfg.train.tbptt}")
