"""The fixed points where a tensor-parallel step talks to the other ranks of its tp group.

Under tensor parallelism (GPN's plan: `gpn_scale.models.gpn.parallelize`, applied to the built
model by `gpn_scale.parallel`) each rank holds its share of the memory
heads and of the FFN hidden units: the column blocks of the fused input matmul for those
(the predict gate stays replicated), the matching rows of the down-projection, and the
memory (B, H/tp, dk, dv) itself. The state s, the gates and the fuse path are replicated,
so per step and layer exactly these collectives run (and nothing else differs):

forward  (1)+(2) in one all-reduce for GPN+M (`reduce_down_with_norm`): the read's output
             RMSNorm spans all H*dv values, so its sum of squares must be summed before the
             norm's scale is known; the scale is per row, so the down-projection's read part
             is summed unscaled beside its FFN part and the sum of squares, and scaled after
             (out = r * sum(read part) + sum(FFN part)). Without memory only (1), the
             row-parallel down-projection's output (B, d) summed (`reduce_rows`). The
             chunk-wide recompute uses the separate forms (`rms_wide`, `reduce_rows`) on all
             the chunk's rows at once (two collectives a chunk, not a step);
backward (3) the sharded column blocks' input gradient dy @ W^T (B, d): summed, the
             replicated predict gate's share added after (`input_grad`);
         (4) the output norm's backward needs the full-width sum of squares and of dn * n:
             one sum of (B, 2) floats (`rms_wide_back`).

With no tp group (tp = 1) every function here is the plain single-rank op, bit for bit.
Every rank of a group receives the same sum (a ring all-reduce ends with an all-gather of
the reduced chunks), so the replicated state stays identical across the group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from gpn_scale.ops.gpn_step.functional import mm_t, rms, rms_back
from gpn_scale.ops.gpn_step.interface import StepPlan


def tp_sum_(x: Tensor, plan: StepPlan) -> Tensor:
    """x summed over the plan's tp group, in place (no-op without one)."""
    if plan.tp_group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=plan.tp_group)
    return x


def reduce_rows(partial: Tensor, plan: StepPlan) -> Tensor:
    """(1): the row-parallel output, summed over the group."""
    return tp_sum_(partial.contiguous() if plan.tp_group is not None else partial, plan)


def rms_wide(x: Tensor, eps: float, plan: StepPlan, out: Tensor | None = None) -> Tensor:
    """(2): RMSNorm over the full width when x holds this rank's 1/tp of the columns
    (`out`: written in place)."""
    if plan.tp_group is None:
        return rms(x, eps, out)
    ss = tp_sum_(x.pow(2).sum(-1, keepdim=True).contiguous(), plan)
    return torch.mul(x, torch.rsqrt(ss / (x.shape[-1] * plan.tp_size) + eps), out=out)


def reduce_down_with_norm(
    read_part: Tensor, ffn_part: Tensor, ss: Tensor, width: int, eps: float, plan: StepPlan
) -> Tensor:
    """(1)+(2) in one all-reduce: the down-projection's output when the read's RMSNorm scale
    r (from the full-width sum of squares) is applied after the sum. read_part: this rank's
    (B, d) product of the unnormalised read columns; ffn_part: its FFN columns' (B, d); ss:
    its (B, k) sums of squares (any split of its columns). One buffer [ss | read | ffn]
    summed; r = rsqrt(sum(ss) / width + eps); returns r * read + ffn."""
    B, d = read_part.shape
    k = ss.shape[-1]
    flat = torch.cat([ss.reshape(-1), read_part.reshape(-1), ffn_part.reshape(-1)])
    tp_sum_(flat, plan)
    total = flat[: B * k].view(B, k).sum(-1, keepdim=True)
    parts = flat[B * k :].view(2, B, d)
    return torch.rsqrt(total / width + eps) * parts[0] + parts[1]


def rms_wide_back(n: Tensor, x: Tensor, dn: Tensor, eps: float, plan: StepPlan) -> Tensor:
    """(4): the gradient of `rms_wide` at x, given dn (both this rank's columns)."""
    if plan.tp_group is None:
        return rms_back(n, x, dn, eps)
    sums = torch.cat([x.pow(2).sum(-1, keepdim=True), (dn * n).sum(-1, keepdim=True)], dim=-1)
    tp_sum_(sums, plan)
    width = x.shape[-1] * plan.tp_size
    r = torch.rsqrt(sums[..., :1] / width + eps)
    return r * (dn - n * (sums[..., 1:] / width))


def input_grad(dy: Tensor, weight_t: Tensor, plan: StepPlan) -> Tensor:
    """(3): dy @ W^T of a layer's fused input matmul (weight_t: its transpose, rows = the
    column blocks). The last d blocks (the predict gate) are replicated: their share is
    added once after the sum, never summed tp times."""
    if plan.tp_group is None:
        return mm_t(dy, weight_t)
    d = plan.d
    sharded = tp_sum_(mm_t(dy[..., :-d], weight_t[:-d]).contiguous(), plan)
    return sharded + mm_t(dy[..., -d:], weight_t[-d:])


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the gradient summed over the group backward (Megatron's "copy to
    tensor-parallel region"). For a replicated parameter that scales sharded columns (the
    RMSNorm weights folded into the write, read and FFN input blocks): each rank's gradient
    is its columns' share, and the replicated parameter needs the whole."""

    @staticmethod
    def forward(ctx, x: Tensor, group: object) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def sum_grad_over_tp(x: Tensor, group: object | None) -> Tensor:
    """x, whose gradient is summed over the tp group (x itself without one)."""
    return x if group is None else _SumGradOverGroup.apply(x, group)
