"""AdamW with the paper's parameter groups, and warmup + cosine-to-floor learning rate.

Weight decay applies to matrices only (every parameter with ndim >= 2, the embedding
included, as in the reference trainer); never to 1-D parameters (norm weights, biases),
A_log or dt_bias. The schedule is a pure function of the step: the trainer sets the
learning rate on the param groups before each optimizer step, so the schedule's "state"
is just the step number saved in the checkpoint (no LR-scheduler object to keep in sync
across FSDP2 / DeepSpeed / resume).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

# Parameter names (last component) that never get weight decay, whatever their shape.
NO_DECAY_NAMES = ("A_log", "dt_bias")


def decays(name: str, param: torch.Tensor) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return param.ndim >= 2 and not any(leaf.endswith(n) for n in NO_DECAY_NAMES)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if decays(name, p) else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def build_adamw(
    model: nn.Module,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    fused: bool = False,
) -> torch.optim.AdamW:
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    # CPU: the per-tensor loop (torch's CPU default, made explicit) gives bit-identical results
    # however parameters are grouped (FSDP2 shards vs whole tensors); the equality tests rely
    # on it. GPU: torch's default (foreach) or fused when asked.
    kwargs = {"fused": True} if fused else ({"foreach": False} if on_cpu else {})
    return torch.optim.AdamW(
        param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, **kwargs
    )


def lr_at(step: int, peak: float, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR for optimizer step `step` (0-based): linear 0 -> peak over warmup, then cosine.

    Step 0 of a warmup gets peak/warmup (not 0, which would waste a step); the cosine runs
    from peak at the end of warmup to peak*min_ratio at the last step (total_steps - 1).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    floor = peak * min_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def grad_norm_and_clip(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients (across FSDP2 shards too) and in-place clipping.

    Returns the pre-clip norm as a plain (replicated) tensor. Clipping is skipped when
    max_norm <= 0 or the norm is not finite (the caller then skips the step anyway).
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    # DTensor gradients live on one mesh per placement kind (FSDP2's dp mesh, or dp x tp when
    # a tp plan covers only some modules): a norm per mesh, reduced across its ranks
    # (full_tensor), then combined; DTensor ops refuse to mix meshes.
    # The clipping's foreach multiply is per mesh too.
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    parts = []
    for group in by_mesh.values():
        grads = [p.grad for p in group if p.grad is not None]  # (all are: typed for mypy)
        part = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        parts.append(part.full_tensor() if hasattr(part, "full_tensor") else part)
    norm = parts[0] if len(parts) == 1 else torch.stack(parts).square().sum().sqrt()
    if max_norm > 0 and torch.isfinite(norm):
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm
