"""Tiny configs and models with non-trivial weights: for the model tests and the device
check (`gpn_scale.bench.gpu`), which hold the engine equal to the reference path."""

from __future__ import annotations

from typing import Any

import torch

from gpn_scale.models.gpn import GPN, GPNConfig

TINY = dict(
    vocab_size=37, d_state=16, d_emb=8, d_ffn=24, n_heads=2, d_key=4, d_value=6, chunk_size=4
)


def tiny_config(**changes) -> GPNConfig:
    values: dict[str, Any] = dict(TINY)
    if changes.get("memory") is False:
        values.update(n_heads=0, d_key=0, d_value=0)
    values.update(changes)
    return GPNConfig(**values)


def perturbed_model(
    cfg: GPNConfig, dtype: torch.dtype = torch.float64, seed: int = 0, scale: float = 0.2
) -> GPN:
    """The reference init zeroes the gates and the FFN output; perturb every parameter so that
    every path of the model (and of its gradient) is exercised."""
    torch.manual_seed(seed)
    model = GPN(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model
