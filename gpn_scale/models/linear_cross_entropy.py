"""Cross-entropy of a linear output head over many positions, a block of rows at a time.

    loss = scale * sum_n CE(h_n @ W^T, y_n)

is computed `rows` positions at a time, with the gradients formed in the same pass (softmax
- onehot, then one matmul each for dL/dh and dL/dW), so peak memory is one (rows x V) block,
never the (N x V) logits, and nothing of size N x V is kept for the backward. Hand-written
because torch has no fused linear + cross-entropy op; the slow form it equals (tested) is
F.cross_entropy(h @ W.T, y, reduction="sum") * scale.

Two users:
- `cross_entropy_block`, one block's loss and gradients, is the part GPN's decode loss
  (models/gpn/loss.py) shares: there h is the decoded block and W the tied embedding E,
  whole or vocabulary-parallel (this rank's V/tp rows, `tp_group` given).
- `linear_cross_entropy` is the baselines' head loss (Transformer++, Gated DeltaNet, via
  models/blocks.py): h the final norm's output, W the head (or the tied embedding's V rows).
  Their heads are replicated under tensor parallelism (each family's parallelize.py), so
  this path never takes a group. Why it exists: an eager 128.6M Transformer++ at B = 64,
  T = 2048 with the full-logits loss peaked at 115 GB on an H200 and B = 128 ran out of
  memory; by count ~50 GB of that peak are the (131,072 x 32000) logits four times over
  (bf16, their float32 copy, its float32 gradient, the bf16 one). Here: one (rows x V)
  block, dL/dh (N x d) and dL/dW (V x d).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpn_scale.ops.cross_entropy import select as select_softmax_xent
from gpn_scale.ops.execution import autocast_dtype
from gpn_scale.ops.gpn_step.functional import add_product_


def cross_entropy_block(
    h: Tensor,
    Em: Tensor,
    tgt: Tensor,
    acc: torch.dtype,
    need_grad: bool,
    total: Tensor,
    dE: Tensor | None,
    tp_group: Any = None,
    v_start: int = 0,
) -> Tensor | None:
    """One block of rows: adds the block's summed CE of h @ Em^T to `total` (in place) and,
    with `need_grad`, adds dL/dEm = g^T h to `dE` and returns dL/dh (rows x e, in h's dtype).

    h: (rows, e) and Em: (V, e) (this rank's (V/tp, e) rows with `tp_group`, starting at
    vocabulary row `v_start`) in the matmul dtype; tgt: (rows,); `acc` the dtype of the
    softmax and of the sums (float32, or float64 for float64 inputs). Returns None without
    `need_grad`. Under tp each rank's share of dh is summed over the group in `acc`.
    dE's product is added to it in `acc` (`functional.add_product_`: one GEMM on CUDA).
    """
    mm = h.dtype
    logits = h @ Em.t()
    if tp_group is not None:  # this rank's V/tp columns (models/gpn/loss.py's docstring)
        block, grad_local = _vocab_parallel_block(logits.to(acc), tgt, v_start, tp_group, need_grad)
        total += block
        if grad_local is None:
            return None
        gm = grad_local.to(mm)
        # Each rank's share of dh in acc, summed there (a bf16 share summed tp times would
        # round tp times): rows x e floats per block.
        dh = (gm @ Em).to(acc)
        dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=tp_group)
        dh = dh.to(mm)
    else:  # the op's backend: one Triton kernel on CUDA, the PyTorch form elsewhere
        block, grad = select_softmax_xent(logits)(logits, tgt, need_grad, acc)
        total += block
        if grad is None:
            return None
        gm = grad
        dh = gm @ Em
    assert dE is not None, "need_grad without a dE accumulator"
    add_product_(dE, gm.t(), h)
    return dh


def _vocab_parallel_block(
    logits: Tensor,
    tgt: Tensor,
    v_start: int,
    group: Any,
    need_grad: bool,
) -> tuple[Tensor, Tensor | None]:
    """One block of the vocabulary-parallel cross-entropy: the block's summed loss (the
    same on every rank) and, when gradients are needed, softmax - onehot of this rank's
    columns (in place over `logits`, rows x V/tp). The Triton kernel (ops/cross_entropy.py)
    normalises over a whole row, so this PyTorch form serves every device under tp."""
    width = logits.shape[1]
    mine = (tgt >= v_start) & (tgt < v_start + width)
    col = (tgt - v_start).clamp(0, width - 1)
    top = logits.amax(dim=-1, keepdim=True)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    picked = torch.where(mine[:, None], logits.gather(1, col[:, None]), 0.0)
    probs = logits.sub_(top).exp_()
    # The sum of exp and the target's logit in one all-reduce of (rows, 2).
    sums = torch.cat([probs.sum(dim=-1, keepdim=True), picked], dim=1)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    denom = sums[:, :1]
    loss = (top + denom.log() - sums[:, 1:]).sum()
    if not need_grad:
        return loss, None
    grad = probs.div_(denom)
    grad[torch.arange(grad.shape[0], device=grad.device), col] -= mine.to(grad.dtype)
    return loss, grad


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        h: Tensor,
        W: Tensor,
        targets: Tensor,
        rows: int,
        mm_dtype: torch.dtype | None,
        scale: float,
        grad_enabled: bool,
    ) -> Tensor:
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        # needs_input_grad stays True under torch.no_grad() (held-out eval): the caller's grad
        # mode, read before apply() (forward itself always runs with grad off), decides.
        need_grad = grad_enabled and any(ctx.needs_input_grad[:2])
        mm = mm_dtype or h.dtype
        Wm = W.to(mm)
        total = torch.zeros((), dtype=acc, device=h.device)
        dH = torch.empty_like(h) if need_grad else None
        dW = torch.zeros(W.shape, dtype=acc, device=h.device) if need_grad else None
        for start in range(0, h.shape[0], rows):
            dh = cross_entropy_block(
                h[start : start + rows].to(mm),
                Wm,
                targets[start : start + rows],
                acc,
                need_grad,
                total,
                dW,
            )
            if dh is not None:
                dH[start : start + rows] = dh  # type: ignore[index]
        if need_grad:
            assert dH is not None and dW is not None
            dH.mul_(scale)
            dW.mul_(scale)
            ctx.save_for_backward(dH, dW)
            ctx.w_dtype = W.dtype
        return total * scale

    @staticmethod
    def backward(ctx, d_total: Tensor):
        dH, dW = ctx.saved_tensors
        # Scaled on the device, never tested against 1 (a host sync per micro-batch; GPN's
        # loss.py says the same), and not in place (repeated backwards stay correct).
        return (
            dH * d_total.to(dH.dtype),
            (dW * d_total).to(ctx.w_dtype),
            None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(h: Tensor, W: Tensor, targets: Tensor, rows: int = 1024) -> Tensor:
    """Mean over every position of CE(h @ W^T, targets), `rows` positions at a time.

    h: (..., e) the head's input; W: (V, e) (nn.Linear layout); targets: h's leading shape.
    The result is float32 (float64 for float64 h). Under autocast the two matmuls of each
    block run in autocast's dtype, as the head's nn.Linear would (the softmax and every sum
    stay float32); otherwise in h's dtype.
    """
    if rows < 1:
        raise ValueError(f"rows: must be >= 1, got {rows}")
    mm_dtype = autocast_dtype(h.device.type)
    flat = h.reshape(-1, h.shape[-1])
    return _ChunkedLinearCrossEntropy.apply(
        flat,
        W,
        targets.reshape(-1),
        rows,
        mm_dtype,
        1.0 / flat.shape[0],
        torch.is_grad_enabled(),
    )
