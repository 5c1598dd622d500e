"""Tied-output cross-entropy over many positions without materialising all logits.

loss_sum = sum_n CE(h_n @ E^T, y_n) is computed `rows` positions at a time; the gradients
with respect to h and E are formed in the same pass (softmax - onehot, one matmul each), so
peak memory is one (rows x V) block, never (N x V). Hand-written because torch has no fused
linear + cross-entropy op; the slow form it equals is F.cross_entropy(h @ E.T, y).
"""

from __future__ import annotations

import torch
from torch import Tensor


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, E: Tensor, targets: Tensor, rows: int,
                mm_dtype: torch.dtype | None) -> Tensor:  # type: ignore[override]
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        Em = E if mm_dtype is None else E.to(mm_dtype)
        total = torch.zeros((), dtype=acc, device=h.device)
        dh = torch.empty_like(h) if need_grad else None
        dE = torch.zeros(E.shape, dtype=acc, device=E.device) if need_grad else None
        for start in range(0, h.shape[0], rows):
            hc = h[start:start + rows]
            hm = hc if mm_dtype is None else hc.to(mm_dtype)
            logits = (hm @ Em.t()).to(acc)
            tgt = targets[start:start + rows]
            picked = logits.gather(1, tgt[:, None])
            top = logits.amax(dim=-1, keepdim=True)
            # In place, so that one (rows x V) block serves logits, exp and the gradient.
            probs = logits.sub_(top).exp_()
            denom = probs.sum(dim=-1, keepdim=True)
            total += (top + denom.log() - picked).sum()
            if need_grad:
                grad = probs.div_(denom)                      # softmax - onehot
                grad[torch.arange(grad.shape[0], device=grad.device), tgt] -= 1.0
                gm = grad.to(Em.dtype)
                dh[start:start + rows] = (gm @ Em).to(h.dtype)
                dE += (gm.t() @ hm).to(acc)
        ctx.save_for_backward(dh, dE)
        ctx.e_dtype = E.dtype
        return total

    @staticmethod
    def backward(ctx, d_total: Tensor):  # type: ignore[override]
        dh, dE = ctx.saved_tensors
        return (dh * d_total.to(dh.dtype), (dE * d_total).to(ctx.e_dtype), None, None, None)


def chunked_linear_cross_entropy(h: Tensor, E: Tensor, targets: Tensor, rows: int = 1024,
                                 mm_dtype: torch.dtype | None = None) -> Tensor:
    """Sum over positions of CE(h @ E^T, targets). h: (N, e), E: (V, e), targets: (N,)."""
    if rows < 1:
        raise ValueError(f"rows: must be >= 1, got {rows}")
    return _ChunkedLinearCrossEntropy.apply(h, E, targets, rows, mm_dtype)
