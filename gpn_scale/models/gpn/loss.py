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

The block after the decode (logits, softmax cross-entropy, dh and dE, the vocabulary-parallel
form included) is `gpn_scale.models.linear_cross_entropy.cross_entropy_block`, which the
baseline families' head loss runs too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gpn_scale.models.gpn.vocab_parallel import vocab_start
from gpn_scale.models.linear_cross_entropy import cross_entropy_block
from gpn_scale.ops.gpn_step.functional import add_product_


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
        dE: Tensor | None = None  # the tied E's gradient, accumulated block by block
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
            dh = cross_entropy_block(
                h,
                Em,
                targets[start : start + rows],
                acc,
                need_grad,
                total,
                dE,
                tp_group,
                v_start,
            )
            if dh is None:
                continue
            add_product_(dW, dh.t(), nw)
            db += dh.sum(0).to(acc)
            dnw = (dh @ Wm).to(P.dtype)
            dw += (dnw * n).sum(0).to(acc)
            dn = dnw * norm_w
            dP[start : start + rows] = r * (dn - n * (dn * n).mean(-1, keepdim=True))
        if need_grad:
            assert dE is not None
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
