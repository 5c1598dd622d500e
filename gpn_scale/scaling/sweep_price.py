"""What a sweep's runs cost under `hardware.mfu: predicted`: the MFU the launch accounting
predicts per model size (accounting/gpu_model.py; under a `parallel.tp=N` override,
accounting/tp_model.py's speed-up) and what that pricing rests on; and the check that a
size's `parallel.tp` splits its model, before the trainer would refuse the run."""

from __future__ import annotations

import functools
from typing import Any

from gpn_scale.core.config import ConfigError
from gpn_scale.models.registry import family_of, titles_where
from gpn_scale.scaling.families import ModelFacts
from gpn_scale.scaling.sweep_spec import SweepError

_ACCOUNTING_GPUS = {"h100": "h100", "h100-sxm": "h100", "h100 sxm": "h100", "h200": "h200"}


def accounting_gpu(name: str) -> str:
    key = _ACCOUNTING_GPUS.get(name.strip().lower())
    if key is None:
        raise SweepError(
            f"hardware.gpu: {name!r} has no launch accounting (H100-SXM, H200); "
            "give a measured hardware.mfu (a fraction) for it"
        )
    return key


def size_mfu(
    where: str,
    config: str,
    facts: ModelFacts,
    overrides: list[str],
    sequences_per_gpu: int,
    seq_len: int,
    gpu: str,
    price: bool,
) -> float:
    """The predicted MFU of one model size (`where`, model config `config`), NaN unless
    `price`; a family without launch accounting is refused."""
    if not family_of(facts.config).launch_accounting:
        raise SweepError(
            f"hardware.mfu: 'predicted' is {titles_where(lambda s: s.launch_accounting)}"
            f"'s launch accounting only, but {where} ({config}) is family "
            f"{facts.registry_name}; give a measured fraction (hardware.mfu: 0.4)"
        )
    return (
        predicted_mfu(facts.config, sequences_per_gpu, seq_len, gpu, tp_override(overrides))
        if price
        else float("nan")
    )


@functools.cache
def predicted_mfu(cfg: Any, sequences_per_gpu: int, seq_len: int, gpu: str, tp: int = 1) -> float:
    # The accounting runs the engine's CUDA code path on meta tensors (accounting/gpu_model.py);
    # under tp, accounting/tp_model.py's speed-up on one 8-GPU node.
    from gpn_scale.accounting.tp_model import predicted_mfu_at_tp

    try:
        return predicted_mfu_at_tp(cfg, sequences_per_gpu, seq_len, gpu, tp)
    except ValueError as err:
        raise SweepError(f"hardware.mfu: 'predicted': {err}; give a measured fraction") from None


@functools.cache
def pricing_basis(gpu: str) -> str:
    # The calibrated accounting names what it rests on: the ceilings a committed device run
    # measured, the kernels it recorded (accounting/ceilings.py, docs/device-runs).
    from gpn_scale.accounting.step_model import pricing_basis as basis

    return basis(gpu)


def tp_override(overrides: list[str]) -> int:
    """The `parallel.tp=N` among a size's overrides (checked by check_tp_override), else 1."""
    tp = 1
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() == "parallel.tp":
            tp = int(value)
    return tp


def check_tp_override(where: str, cfg: Any, overrides: list[str]) -> None:
    """`parallel.tp=N` among a size's overrides: its heads and FFN width must split N ways
    (the trainer would refuse the run at start; `sweep plan` says so first)."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() != "parallel.tp":
            continue
        try:
            tp = int(value)
        except ValueError:
            raise SweepError(f"{where}.overrides: '{o}': tp must be an integer") from None
        if tp < 1:
            raise SweepError(f"{where}.overrides: '{o}': tp must be >= 1")
        spec = family_of(cfg)
        if tp > 1 and spec.apply_tp is None:
            raise SweepError(f"{where}.overrides: '{o}': family {spec.name} has no tp plan")
        try:
            spec.check_tp(cfg, tp)
        except ConfigError as err:
            raise SweepError(f"{where}.overrides: {err}") from None
