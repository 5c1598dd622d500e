"""The backward's chunk-wide recompute: every activation of a chunk at once, from the states
entering its steps (the forward keeps only those).

Every projection is ONE (C*B)-row matmul and the memory is the fully parallel chunk form
(`ops.memory`, use 1): no few-row matmul, no step loop. Every activation the reverse sweep
reads is written by the op that makes it (a GEMM's `out`, a fused kernel's store) into the
workspace it is handed (`workspace.Workspace`, one of the two the chunks alternate between):
the reverse graphs bind them by address (`ChunkActs.BOUND`), so a replay copies none of them
in (~2.8 GB a chunk at 130M and B = 128). The elementwise chains run as one kernel each on
CUDA (`fused.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from gpn_scale.ops.gpn_step import fused as _fused
from gpn_scale.ops.gpn_step.collectives import reduce_rows, rms_wide
from gpn_scale.ops.gpn_step.functional import matmul as _matmul
from gpn_scale.ops.gpn_step.functional import matmul_copy_dtype
from gpn_scale.ops.gpn_step.functional import rms as _rms
from gpn_scale.ops.gpn_step.interface import ChunkActs, LoopWeights, StepPlan
from gpn_scale.ops.gpn_step.workspace import Workspace
from gpn_scale.ops.memory import batched_mm, chunk_errors, chunk_read, masked_exp

Kept = Callable[..., Tensor]  # (name, shape, chunk_dim=0) -> the workspace's tensor


@torch.no_grad()
def recompute_chunk(
    plan: StepPlan,
    W: LoopWeights,
    S: Tensor,
    s_prev: Tensor,
    M0: Tensor | None,
    ws: Workspace,
) -> ChunkActs:
    """Given the states S (B, C, d) entering each step, the whole chunk at once."""
    B, C, d = S.shape
    mem, eps = plan.memory, plan.eps

    def kept(name: str, shape: tuple[int, ...], chunk_dim: int | None = 0) -> Tensor:
        return ws.compact(f"act.{name}", shape, chunk_dim, S.dtype)

    # torch.split takes any sequence of sizes (its stub says list).
    splits = cast("tuple[list[int], ...]", plan.in_splits)
    # On the GPU path under autocast the norms also write their rows in the matmul dtype:
    # the GEMMs and the weight gradients read those (`fused.rms`).
    low_dt = matmul_copy_dtype(S, plan.mm_dtype)
    low = lambda: None if low_dt is None else S.new_empty((C, B, d), dtype=low_dt)  # noqa: E731
    n_lows: list[Tensor] = []
    c = kept("c0", (C, B, d))
    cs, ns, ys, hiddens = [], [], [], []
    o_s: list[Tensor | None] = []
    ro_s: list[Tensor | None] = []
    q_s: list[Tensor | None] = []
    rq_s: list[Tensor | None] = []
    written: tuple[Tensor, ...] = ()
    for i in range(plan.n_layers):
        n, n_low = kept(f"n{i}", (C, B, d)), low()
        # (layer 0 reads S and writes its copy c0 on the way)
        _fused.rms(S.transpose(0, 1) if i == 0 else c, eps, n, n_low, c if i == 0 else None)
        y_buf = kept(f"y{i}", (C, B, W.w_in[i].shape[1]))
        y = _matmul(n if n_low is None else n_low, W.w_in[i], W.b_in[i], y_buf, S.dtype)
        n_lows += [n_low] if n_low is not None else []
        cs.append(c)
        ns.append(n)
        ys.append(y)
        parts = torch.split(y, splits[i], dim=-1)
        if mem and i == 0:
            *writes, q_pre, rg, ffn_in, pg = parts
            assert M0 is not None
            written = _memory_writes(plan, W, kept, writes, s_prev, M0)
        elif mem:
            q_pre, rg, ffn_in, pg = parts
        else:
            ffn_in, pg = parts
        read = _memory_read(plan, kept, i, q_pre, written, M0) if mem else (None,) * 4
        for acc, t in zip((q_s, rq_s, o_s, ro_s), read):
            acc.append(t)
        # In the dtype the down GEMM and its weight gradient read (one kernel on CUDA).
        # Read by the weight gradients only: not kept.
        a, b = ffn_in.chunk(2, dim=-1)
        hidden = _fused.down_input(rg if mem else None, ro_s[-1], a, b, low_dt or S.dtype)
        hiddens.append(hidden)
        z = reduce_rows(_matmul(hidden, W.w_out[i], None, out_dtype=S.dtype), plan)
        c = _fused.gated_residual(pg, c, z, kept(f"c{i + 1}", (C, B, d)))
    n_p, n_p_low = kept("n_p", (C, B, d)), low()
    _fused.rms(c, eps, n_p, n_p_low)
    a_fg = n_p if n_p_low is None else n_p_low
    gate = _matmul(a_fg, W.w_fg, W.b_fg, kept("gate", (C, B, d)), out_dtype=S.dtype).sigmoid_()
    acts = ChunkActs(cs, ns, ys, hiddens, o_s, ro_s, q_s, rq_s, n_p, gate, c)
    acts.n_low, acts.n_p_low = n_lows, n_p_low
    if mem:
        acts.s_prev = s_prev
        (acts.n_sprev, acts.k_pre, acts.k, acts.v, acts.beta, acts.U, acts.G, acts.pred,
         acts.rk) = written  # fmt: skip
    return acts


def _memory_writes(
    plan: StepPlan, W: LoopWeights, kept: Kept, parts: list[Tensor], s_prev: Tensor, M: Tensor
) -> tuple[Tensor, ...]:
    """GPN+M's first layer: the chunk's keys (the first from s_prev), values, write
    strengths, decays, errors U and predictions: (n_sprev, k_pre, k, v, beta, U, G, pred,
    rk), each made where the sweep reads it."""
    k_next_pre, v_pre, beta_pre, decay_pre = parts
    C, B = k_next_pre.shape[:2]
    H, dk, dv = plan.H, plan.dk, plan.dv
    assert W.A is not None  # GPN+M: the decay rates
    k_cols = H * dk
    n_sprev = _rms(s_prev, plan.eps, kept("n_sprev", tuple(s_prev.shape), None))
    k_first = _matmul(n_sprev, W.w_in[0][:, :k_cols], W.b_in[0][:k_cols])
    k_pre = torch.cat([k_first[None], k_next_pre[:-1]], 0, out=kept("k_pre", (C, B, k_cols)))
    K = _heads(_fused.l2n_relu(k_pre, kept("k", (C, B, H, dk))))
    V = _heads(v_pre.reshape(C, B, H, dv))  # a view of y
    log_a = (-W.A * F.softplus(decay_pre)).permute(1, 2, 0)  # (B, H, C)
    beta = torch.sigmoid(beta_pre, out=kept("beta", (C, B, H))).permute(1, 2, 0)
    # k @ M0 once, by its GEMM straight into the sweep's step-major layout
    rk = batched_mm(K, M, _step_major_view(kept("rk", (C, B, H, dv))))
    kk = K @ K.mT  # once: the errors' solve and the predictions both need it
    U, G = chunk_errors(K, V, log_a, beta, M, "gpn", kM0=rk, kk=kk)
    # (the solve returns U column-major; the sweep reads rows)
    U = kept("U", tuple(U.shape), 2).copy_(U)
    G = kept("G", tuple(G.shape), 2).copy_(G)
    pred = _prediction(kk, U, G, rk, _step_major_view(kept("pred", (C, B, H, dv))))
    return n_sprev, k_pre, K, V, beta, U, G, pred, rk


def _memory_read(
    plan: StepPlan,
    kept: Kept,
    i: int,
    q_pre: Tensor,
    written: tuple[Tensor, ...],
    M: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Layer i's read of the chunk's memory: (q, rq = q M0, o, rms(o))."""
    assert M is not None
    K, U, G = written[2], written[5], written[6]
    C, B = q_pre.shape[:2]
    H, dk, dv = plan.H, plan.dk, plan.dv
    q = _heads(_fused.l2n_relu(q_pre, kept(f"q{i}", (C, B, H, dk))))
    # q @ M0 once: the read below and the sweep (as rq) both need it
    rq = batched_mm(q, M, _step_major_view(kept(f"rq{i}", (C, B, H, dv))))
    o = kept(f"o{i}", (C, B, H * dv))
    chunk_read(q, K, U, G, M, rq, _heads(o.view(C, B, H, dv)))
    ro = kept(f"ro{i}", (C, B, H * dv))
    if plan.tp_group is None:
        _fused.rms(o, plan.eps, ro)
    else:  # its sum of squares spans the group
        rms_wide(o, plan.eps, plan, ro)
    return q, rq, o, ro


def _prediction(kk: Tensor, U: Tensor, G: Tensor, rk: Tensor, out: Tensor) -> Tensor:
    """M_{t-1}^T k_t for every step (rk = M0^T k_t, kk = K K^T) into `out`:
    e^{G_{t-1}} M0^T k_t + sum_{j<t} e^{G_{t-1}-G_j}(k_t.k_j) u_j."""
    G_prev = torch.cat([torch.zeros_like(G[..., :1]), G[..., :-1]], dim=-1)
    C = G.shape[-1]
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=G.device), diagonal=-1)
    batched_mm(kk * masked_exp(G_prev[..., :, None] - G[..., None, :], strict), U, out)
    return out.addcmul_(G_prev.exp()[..., None], rk)


def _step_major_view(buffer: Tensor) -> Tensor:
    """A (C, B, H, n) buffer as (B, H, C, n): the reverse sweep reads these one step at a
    time, and a step's rows for every head and batch row then lie together (prefetchable)
    instead of C*n apart. The GEMMs that make them write them there."""
    return buffer.permute(1, 2, 0, 3)


def _heads(x: Tensor) -> Tensor:
    """(C, B, H, n) -> (B, H, C, n)."""
    return x.permute(1, 2, 0, 3)
