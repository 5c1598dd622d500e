"""Matmuls whose weight gradient is deferred and computed once per chunk.

Inside a recurrence, autograd would form a weight gradient at every step: a rank-B update
(B = batch rows) written over the whole weight matrix, T times. Here the per-step backward
only forms the input gradient (dy @ W^T) and records dy; `DeferredSlot.weight_grad` later
turns all of a chunk's (x, dy) pairs into ONE large matmul X^T @ dY. The same serves the
per-sequence memory M0 that every step of a chunk reads (batched matmul, (B, H) leading).

A slot may also carry `replay` values: the outputs of its successive calls, computed
beforehand in one large matmul over all steps of a chunk (possible when the inputs of
every step are already known, as in a backward-pass recomputation). The per-step call then
returns its precomputed row block instead of running a few-row matmul, while autograd still
sees x -> y and so the backward is unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor


class DeferredSlot:
    """Collects the inputs and output gradients of every matmul against one weight."""

    __slots__ = ("xs", "dys", "replay")

    def __init__(self, replay: Tensor | None = None) -> None:
        self.xs: list[Tensor] = []
        self.dys: list[Tensor | None] = []
        self.replay = replay      # (calls, ...): output of call i is replay[i]

    def weight_grad(self, dtype: torch.dtype) -> tuple[Tensor, Tensor] | None:
        """(X^T @ dY, dY summed over rows) over all recorded calls, or None if none got a grad."""
        pairs = [(x, dy) for x, dy in zip(self.xs, self.dys) if dy is not None]
        if not pairs:
            return None
        X = torch.cat([x.to(dtype) for x, _ in pairs], dim=-2)
        dY = torch.cat([dy.to(dtype) for _, dy in pairs], dim=-2)
        return X.mT @ dY, dY.sum(dim=-2)


class _DeferredMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, slot: DeferredSlot
                ) -> Tensor:  # type: ignore[override]
        ctx.weight = weight  # a constant of the chunk: never saved through autograd
        ctx.slot = slot
        ctx.index = len(slot.xs)
        ctx.out_dtype = x.dtype
        slot.xs.append(x)
        slot.dys.append(None)
        if slot.replay is not None:
            return slot.replay[ctx.index]
        return _matmul(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        ctx.slot.dys[ctx.index] = dy
        w = ctx.weight
        dx = (dy.to(w.dtype) @ w.mT).to(ctx.out_dtype)
        return dx, None, None, None


def _matmul(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight (+ bias) in the weight's dtype (bf16 under autocast), result in x's dtype."""
    out_dtype = x.dtype
    if weight.dtype != out_dtype:
        y = (x.to(weight.dtype) @ weight).to(out_dtype)
        return y if bias is None else y + bias
    if bias is not None and x.dim() == 2:
        return torch.addmm(bias, x, weight)
    y = x @ weight
    return y if bias is None else y + bias


def deferred_matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None,
                    slot: DeferredSlot | None = None) -> Tensor:
    """x @ weight (+ bias). With a slot, the backward gives dx now and leaves dW/db to the slot.

    `weight` and `bias` must not require grad (they are the chunk's constants).
    """
    if slot is None:
        return _matmul(x, weight, bias)
    return _DeferredMatmul.apply(x, weight, bias, slot)
