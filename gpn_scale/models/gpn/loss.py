"""Decode + tied-output cross-entropy over many positions, without materialising the logits.

    loss_sum = sum_n CE((rms(p_n) * w) @ W_dec^T + b) @ E^T, y_n)

is computed `rows` positions at a time, and the gradients with respect to p, w, W_dec, b
and E are formed in the same pass (softmax - onehot, then one matmul each), so peak memory
is one (rows x V) block, never (N x V), and nothing of size N is kept for the backward but
dL/dp. Hand-written because torch has no fused linear + cross-entropy op; the slow form it
equals (tested) is F.cross_entropy(decode(p) @ E.T, y, reduction="sum").

Vocabulary-parallel form (tensor parallelism, `tp_group` given; E is then this rank's
(V/tp, e) rows, Megatron's vocab_parallel_cross_entropy done block by block): per block
h = decode(p) is computed on every rank (replicated: rows x e), the logits only for the
local vocabulary (rows x V/tp), their row max all-reduced (MAX, rows floats), then the sum
of exp and the target's logit (held by one rank, the others add 0) in one all-reduce of
(rows, 2); the loss is the same on every rank. Backward in the same pass: softmax - onehot
of the local columns, dE_local = g^T h on this rank alone, dh = g @ E_local summed over the
group (rows x e), and W_dec, b, the norm and P from the full dh as without tp. No rank ever
holds more than (rows x V/tp) logits. megatron-core's function is not used: it takes the
whole logits tensor and megatron's global tp group, and keeps the softmax for a separate
backward, where here each block's gradients (the tied E included) are formed at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gpn_scale.models.gpn.vocab_parallel import vocab_start
from gpn_scale.ops.cross_entropy import softmax_xent_, use_triton


class _ChunkedDecodeCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        P: Tensor,
        norm_w: Tensor,
        W_dec: Tensor,
        b_dec: Tensor | None,
        E: Tensor,
        targets: Tensor,
        rows: int,
        eps: float,
        mm_dtype: torch.dtype | None,
        scale: float,
        grad_enabled: bool,
        tp_group: Any,
        v_start: int,
    ) -> Tensor:
        acc = torch.float64 if P.dtype == torch.float64 else torch.float32
        # needs_input_grad stays True under torch.no_grad() (held-out eval): the caller's grad
        # mode, read before apply() (forward itself always runs with grad off), decides.
        need_grad = grad_enabled and any(ctx.needs_input_grad[:5])
        mm = mm_dtype or P.dtype
        Em, Wm = E.to(mm), W_dec.to(mm)
        total = torch.zeros((), dtype=acc, device=P.device)
        if need_grad:
            dP = torch.empty_like(P)
            dw = torch.zeros(norm_w.shape, dtype=acc, device=P.device)
            dW = torch.zeros(W_dec.shape, dtype=acc, device=P.device)
            db = torch.zeros(W_dec.shape[0], dtype=acc, device=P.device)
            dE = torch.zeros(E.shape, dtype=acc, device=P.device)
        for start in range(0, P.shape[0], rows):
            p = P[start : start + rows]
            r = torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + eps)
            n = p * r
            nw = (n * norm_w).to(mm)
            h = nw @ Wm.t()
            if b_dec is not None:
                h = h + b_dec.to(mm)
            tgt = targets[start : start + rows]
            logits = h @ Em.t()
            if tp_group is not None:  # this rank's V/tp columns (see the module docstring)
                block, grad_local = _vocab_parallel_block(
                    logits.to(acc), tgt, v_start, tp_group, need_grad
                )
                total += block
                if grad_local is None:
                    continue
                gm = grad_local.to(mm)
                # Each rank's share of dh in acc, summed there (a bf16 share summed tp times
                # would round tp times): rows x e floats per block.
                dh = (gm @ Em).to(acc)
                dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=tp_group)
                dh = dh.to(mm)
            elif use_triton(logits):  # one kernel, the block read twice (ops/cross_entropy.py)
                total += softmax_xent_(logits, tgt, need_grad).sum()
                if not need_grad:
                    continue
                gm = logits  # softmax - onehot, in mm
            else:
                logits = logits.to(acc)
                picked = logits.gather(1, tgt[:, None])
                top = logits.amax(dim=-1, keepdim=True)
                # In place, so that one (rows x V) block serves logits, exp and the gradient.
                probs = logits.sub_(top).exp_()
                denom = probs.sum(dim=-1, keepdim=True)
                total += (top + denom.log() - picked).sum()
                if not need_grad:
                    continue
                grad = probs.div_(denom)  # softmax - onehot
                grad[torch.arange(grad.shape[0], device=grad.device), tgt] -= 1.0
                gm = grad.to(mm)
            if tp_group is None:
                dh = gm @ Em
            dE += (gm.t() @ h).to(acc)
            dW += (dh.t() @ nw).to(acc)
            db += dh.sum(0).to(acc)
            dnw = (dh @ Wm).to(P.dtype)
            dw += (dnw * n).sum(0).to(acc)
            dn = dnw * norm_w
            dP[start : start + rows] = r * (dn - n * (dn * n).mean(-1, keepdim=True))
        if need_grad:
            for g in (dP, dw, dW, db, dE):
                g.mul_(scale)
            ctx.save_for_backward(dP, dw, dW, db, dE)
            ctx.has_bias = b_dec is not None
            ctx.dtypes = (norm_w.dtype, W_dec.dtype, E.dtype)
        return total * scale

    @staticmethod
    def backward(ctx, d_total: Tensor):
        dP, dw, dW, db, dE = ctx.saved_tensors
        w_dt, W_dt, E_dt = ctx.dtypes
        # Always scaled on the device: testing d_total == 1 to skip the (N x d) product cost a
        # host sync every micro-batch (x * 1.0 == x exactly, so results are unchanged), and
        # the loop's loss / accum makes it != 1 whenever gradients accumulate anyway. Not in
        # place, so that repeated backwards (retain_graph) stay correct.
        return (
            dP * d_total.to(dP.dtype),
            (dw * d_total).to(w_dt),
            (dW * d_total).to(W_dt),
            (db * d_total).to(W_dt) if ctx.has_bias else None,
            (dE * d_total).to(E_dt),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


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


def chunked_decode_cross_entropy(
    P: Tensor,
    norm_w: Tensor,
    W_dec: Tensor,
    b_dec: Tensor | None,
    E: Tensor,
    targets: Tensor,
    rows: int = 1024,
    eps: float = 1e-6,
    mm_dtype: torch.dtype | None = None,
    scale: float = 1.0,
    tp_group: Any = None,
) -> Tensor:
    """`scale` x the sum over positions of CE(decode(P) @ E^T, targets).

    P: (N, d) predicted states; norm_w: (d,); W_dec: (e, d) (nn.Linear layout); b_dec: (e,)
    or None; E: (V, e) the tied embedding; targets: (N,). Matmuls run in `mm_dtype` if given.
    With `tp_group` E is this rank's (V/tp, e) rows (rank r: rows r V/tp ..), P, the decoder
    and the targets are the group's (replicated), and so is the returned loss; E's gradient
    is this rank's rows.
    """
    if rows < 1:
        raise ValueError(f"rows: must be >= 1, got {rows}")
    v_start = vocab_start(E, tp_group)
    return _ChunkedDecodeCrossEntropy.apply(
        P,
        norm_w,
        W_dec,
        b_dec,
        E,
        targets,
        rows,
        eps,
        mm_dtype,
        scale,
        torch.is_grad_enabled(),
        tp_group,
        v_start,
    )
