"""The PyTorch steps: the spec every other step backend is held to.

Plain tensor ops on any device, one step at a time; the forward is `shared/spec/gpn-model.md`
with the memory in chunk form (a read-only chunk-start M0 plus the chunk's low-rank history,
`shared/spec/memory-chunkwise.md`), and the reverse sweep is that forward differentiated by
hand (held equal to autograd through the step-by-step model by tests/models/gpn/test_engine.py).
Under tensor parallelism it calls the group's collectives at the fixed points of
`collectives.py` (the backend of CPU tensors under tp; the CUDA backend splits its kernels at
the same points).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from gpn_scale.ops.gpn_step.collectives import (
    input_grad,
    reduce_down_with_norm,
    reduce_rows,
    rms_wide,
    rms_wide_back,
)
from gpn_scale.ops.gpn_step.functional import l2n, l2n_back, matmul, mm_t, rms, rms_back, silu_back
from gpn_scale.ops.gpn_step.interface import (
    ChunkForward,
    ChunkForwardResult,
    LoopWeights,
    MemoryActs,
    MemoryAdjoints,
    ReverseSweep,
    ReverseSweepResult,
    StepPlan,
    read_values,
)


class _ChunkHistory:
    """The chunk's k_j, u_j, G_j so far, in preallocated buffers (no copy of the history per
    step)."""

    def __init__(self, B: int, H: int, C: int, dk: int, dv: int, like: Tensor) -> None:
        self.K = like.new_empty(B, H, C, dk)
        self.U = like.new_empty(B, H, C, dv)
        self.G = like.new_empty(B, H, C)

    def append(self, tau: int, k: Tensor, u: Tensor, G: Tensor) -> None:
        self.K[:, :, tau] = k
        self.U[:, :, tau] = u
        self.G[:, :, tau] = G

    def upto(self, n: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.K[:, :, :n], self.U[:, :, :n], self.G[:, :, :n]


class ReferenceBackend:
    """The PyTorch steps (any device)."""

    name = "reference"
    row_alignment = 1
    matmul_only_adjoints: tuple[str, ...] = ()

    def forward_chunk(
        self, plan: StepPlan, W: LoopWeights, chunk: ChunkForward
    ) -> ChunkForwardResult:
        return forward_chunk(plan, W, chunk)

    def reverse_sweep(
        self, plan: StepPlan, Wt: LoopWeights, sweep: ReverseSweep
    ) -> ReverseSweepResult:
        return reverse_sweep(plan, Wt, sweep)


@torch.no_grad()
def forward_chunk(plan: StepPlan, W: LoopWeights, chunk: ChunkForward) -> ChunkForwardResult:
    """The steps of one chunk (no autograd)."""
    fuse, s, s_prev, P, S_out = chunk.fuse, chunk.s, chunk.s_prev, chunk.P, chunk.S
    B, C, _ = fuse.shape
    H, dk, dv, eps = plan.H, plan.dk, plan.dv, plan.eps
    mem = plan.memory
    # torch.split takes any sequence of sizes (its stub says list).
    splits = cast("tuple[list[int], ...]", plan.in_splits)
    if mem:  # GPN+M: the chunk-start memory and the decay rates are given
        assert chunk.M0 is not None and W.A is not None
        M0, A = read_values(chunk.M0, s), W.A
        k_cols = H * dk
        k = l2n(
            F.relu(matmul(rms(s_prev, eps), W.w_in[0][:, :k_cols], W.b_in[0][:k_cols])).view(
                B, H, dk
            )
        )
        history = _ChunkHistory(B, H, C, dk, dv, s)
        G_prev = s.new_zeros(B, H)
    for tau in range(C):
        if S_out is not None:
            S_out[:, tau] = s
        c = s
        for i in range(plan.n_layers):
            y = matmul(rms(c, eps), W.w_in[i], W.b_in[i])
            parts = torch.split(y, splits[i], dim=-1)
            if mem and i == 0:
                k_next_pre, v, beta_pre, decay_pre, q_pre, rg, ffn_in, pg = parts
                v = v.view(B, H, dv)
                G = G_prev + (-A * F.softplus(decay_pre))
                q = l2n(F.relu(q_pre).view(B, H, dk))
                # One read of M0 for the key (error term) and the query (read after write).
                kq = torch.stack([k, q], dim=2)
                r = kq @ M0
                err_base = G_prev.exp()[..., None] * r[:, :, 0]
                out_base = G.exp()[..., None] * r[:, :, 1]
                if tau:
                    K, U, Gj = history.upto(tau)  # (B, H, tau, dk), (.., dv), (B, H, tau)
                    expo = torch.stack([G_prev, G], dim=2)[..., None] - Gj[:, :, None, :]
                    hist = ((kq @ K.mT) * expo.exp()) @ U
                    err_base = err_base + hist[:, :, 0]
                    out_base = out_base + hist[:, :, 1]
                u = torch.sigmoid(beta_pre)[..., None] * (v - err_base)
                o = out_base + (q * k).sum(-1, keepdim=True) * u
                history.append(tau, k, u, G)
                G_prev = G
                k = l2n(F.relu(k_next_pre).view(B, H, dk))
            elif mem:
                q_pre, rg, ffn_in, pg = parts
                q = l2n(F.relu(q_pre).view(B, H, dk))
                K, U, Gj = history.upto(tau + 1)
                w = (q[:, :, None] @ K.mT) * (G[..., None, None] - Gj[:, :, None, :]).exp()
                o = G.exp()[..., None] * (q[:, :, None] @ M0)[:, :, 0] + (w @ U)[:, :, 0]
            else:
                ffn_in, pg = parts
            a, b = ffn_in.chunk(2, dim=-1)
            hidden = F.silu(a) * b
            if mem and plan.tp_group is not None:  # (1)+(2) as one all-reduce
                o = o.reshape(B, H * dv)
                w_out = W.w_out[i]
                down = reduce_down_with_norm(
                    matmul(F.silu(rg) * o, w_out[: H * dv], None),
                    matmul(hidden, w_out[H * dv :], None),
                    o.pow(2).sum(-1, keepdim=True),
                    H * dv * plan.tp_size,
                    eps,
                    plan,
                )
                c = torch.sigmoid(pg) * c + down
                continue
            if mem:
                ro = rms_wide(o.reshape(B, H * dv), eps, plan)
                hidden = torch.cat([F.silu(rg) * ro, hidden], dim=-1)
            c = torch.sigmoid(pg) * c + reduce_rows(matmul(hidden, W.w_out[i], None), plan)
        P[:, tau] = c
        gate = torch.sigmoid(matmul(rms(c, eps), W.w_fg, W.b_fg))
        s_prev, s = s, gate * c + fuse[:, tau]
    if not mem:
        return ChunkForwardResult(s, s_prev)
    K, U, Gj = history.upto(C)
    return ChunkForwardResult(s, s_prev, K, U, Gj)


@torch.no_grad()
def reverse_sweep(plan: StepPlan, Wt: LoopWeights, sweep: ReverseSweep) -> ReverseSweepResult:
    """The per-step reverse sweep of one chunk, adding into `sweep.adjoints`."""
    acts, dP, adj = sweep.acts, sweep.dP, sweep.adjoints
    C, B, d = acts.p.shape
    H, dk, dv, eps, L = plan.H, plan.dk, plan.dv, plan.eps, plan.n_layers
    mem = plan.memory
    # torch.split takes any sequence of sizes (its stub says list).
    splits = cast("tuple[list[int], ...]", plan.in_splits)
    dt = dP.dtype
    dY, dZ, dYfg, d_fuse = adj.dY, adj.dZ, adj.dYfg, adj.d_fuse
    dRq = adj.dRq
    ds_extra = torch.zeros(C, B, d, dtype=dt, device=dP.device)
    if sweep.ds_prev_end is not None:
        ds_extra[C - 1] += sweep.ds_prev_end  # s_prev at the end = state entering step C-1
    dk_pre0 = None
    if mem:  # GPN+M: the memory activations, adjoints, M0 and the decay rates are given
        m, madj = acts.memory(), adj.memory()
        assert sweep.M0 is not None and Wt.A is not None
        A = Wt.A
        Hk, Hv = H * dk, H * dv
        K, U, G = m.k, m.U, m.G
        dK, dU, dG = madj.dK, madj.dU, madj.dG
        dk_next_pre = torch.zeros(B, Hk, dtype=dt, device=dP.device)  # d(pre-activation of k_{t+1})
        M0t = read_values(sweep.M0, dP).mT.contiguous()
        dG_suffix = torch.zeros(B, H, dtype=dt, device=dP.device)
    dg = sweep.ds_end if sweep.ds_end is not None else torch.zeros(B, d, dtype=dt, device=dP.device)
    for tau in range(C - 1, -1, -1):
        # Ground: s_next = gate * p + fuse.
        p, gate = acts.p[tau], acts.gate[tau]
        d_fuse[:, tau] = dg
        dyfg = dg * p * gate * (1 - gate)
        dYfg[tau] = dyfg
        dc = dP[:, tau] + gate * dg + rms_back(acts.n_p[tau], p, mm_t(dyfg, Wt.w_fg), eps)
        for i in range(L - 1, -1, -1):
            c_in, n_in = acts.c[i][tau], acts.n[i][tau]
            parts = torch.split(acts.y[i][tau], splits[i], dim=-1)
            dparts = list(torch.split(dY[i][tau], splits[i], dim=-1))  # views into dY
            pg = parts[-1]
            sg = torch.sigmoid(pg)
            dZ[i][tau] = dc
            dparts[-1].copy_(dc * c_in * sg * (1 - sg))
            dc_in = dc * sg
            dh = mm_t(dc, Wt.w_out[i])
            fa, fb = parts[-2].chunk(2, dim=-1)
            dfa, dfb = dparts[-2].chunk(2, dim=-1)
            dh_ffn = dh[:, -plan.f :]
            dfa.copy_(silu_back(fa, dh_ffn * fb))
            dfb.copy_(dh_ffn * F.silu(fa))
            if mem:
                q_pre, rg = parts[-4], parts[-3]
                ro = m.ro[i][tau]
                dh_read = dh[:, :Hv]
                dparts[-3].copy_(silu_back(rg, dh_read * ro))
                do = rms_wide_back(ro, m.o[i][tau], dh_read * F.silu(rg), eps, plan)
                do = do.view(B, H, dv)
                # Read after write: o = e^{G_t} M0^T q + sum_{j<=t} e^{G_t - G_j} (q.k_j) u_j.
                q = m.q[i][:, :, tau]
                Gt = G[..., tau]
                eG = Gt.exp()
                drq = eG[..., None] * do
                dRq[i][:, :, tau] = drq
                dq = (drq[:, :, None] @ M0t)[:, :, 0]
                dGt = eG * (do * m.rq[i][:, :, tau]).sum(-1)
                Kh, Uh = K[:, :, : tau + 1], U[:, :, : tau + 1]
                w = (Gt[..., None] - G[..., : tau + 1]).exp()
                sdot = (Kh @ q[..., None])[..., 0]
                da = (Uh @ do[..., None])[..., 0]
                dU[:, :, : tau + 1] += (w * sdot)[..., None] * do[:, :, None]
                dsd = da * w
                dq = dq + (dsd[:, :, None] @ Kh)[:, :, 0]
                dK[:, :, : tau + 1] += dsd[..., None] * q[:, :, None]
                dw = dsd * sdot
                dG[..., : tau + 1] -= dw
                dG[..., tau] += dGt + dw.sum(-1)
                dparts[-4].copy_(l2n_back(q_pre.view(B, H, dk), dq).view(B, Hk))
            if mem and i == 0:
                _write_backward(plan, A, m, M0t, tau, parts, dparts, madj, dk_next_pre, dG_suffix)
                dk_pre = l2n_back(m.k_pre[tau].view(B, H, dk), dK[:, :, tau]).view(B, Hk)
                if tau:
                    dk_next_pre = dk_pre
                else:
                    dk_pre0 = dk_pre
            dc = dc_in + rms_back(n_in, c_in, input_grad(dY[i][tau], Wt.w_in[i], plan), eps)
        dc = dc + ds_extra[tau]
        dg = dc  # gradient of the state entering step tau
    return ReverseSweepResult(dg, dk_pre0)


def _write_backward(
    plan: StepPlan,
    A: Tensor,
    acts: MemoryActs,
    M0t: Tensor,
    tau: int,
    parts: tuple[Tensor, ...],
    dparts: list[Tensor],
    adj: MemoryAdjoints,
    dk_next_pre: Tensor,
    dG_suffix: Tensor,
) -> None:
    """Step tau's memory write, reversed: u_t = beta (v - M_{t-1}^T k_t) and the decay.

    Fills the write blocks of layer 0's input gradient (`dparts`) and adds to the chunk's
    adjoints of k, u and G (dK, dU, dG) and to dA; dG_suffix is updated in place.
    """
    dK, dU, dG, dRk, dA = adj.dK, adj.dU, adj.dG, adj.dRk, adj.dA
    B, H, dv = dK.shape[0], plan.H, plan.dv
    G = acts.G
    du = dU[:, :, tau]
    beta = acts.beta[..., tau]
    dparts[0].copy_(dk_next_pre)  # k_{t+1} is computed at step t
    dparts[2].copy_((du * (acts.v[:, :, tau] - acts.pred[:, :, tau])).sum(-1) * beta * (1 - beta))
    dvv = beta[..., None] * du
    dparts[1].copy_(dvv.reshape(B, H * dv))
    dpred = -dvv
    # pred = e^{G_{t-1}} M0^T k_t + sum_{j<t} e^{G_{t-1} - G_j} (k_t.k_j) u_j
    k = acts.k[:, :, tau]
    G_prev = G[..., tau - 1] if tau else torch.zeros_like(G[..., 0])
    eGp = G_prev.exp()
    drk = eGp[..., None] * dpred
    dRk[:, :, tau] = drk
    dk = (drk[:, :, None] @ M0t)[:, :, 0]
    if tau:
        dGp = eGp * (dpred * acts.rk[:, :, tau]).sum(-1)
        Kh, Uh = acts.k[:, :, :tau], acts.U[:, :, :tau]
        w = (G_prev[..., None] - G[..., :tau]).exp()
        sdot = (Kh @ k[..., None])[..., 0]
        da = (Uh @ dpred[..., None])[..., 0]
        dU[:, :, :tau] += (w * sdot)[..., None] * dpred[:, :, None]
        dsd = da * w
        dk = dk + (dsd[:, :, None] @ Kh)[:, :, 0]
        dK[:, :, :tau] += dsd[..., None] * k[:, :, None]
        dw = dsd * sdot
        dG[..., :tau] -= dw
        dG[..., tau - 1] += dGp + dw.sum(-1)
    dK[:, :, tau] += dk
    # G_t = G_{t-1} + log a_t, so d log a_t = sum over t' >= t of dG_t' (complete by now).
    dG_suffix += dG[..., tau]
    decay_pre = parts[3]
    dparts[3].copy_(dG_suffix * (-A) * torch.sigmoid(decay_pre))
    dA -= (dG_suffix * F.softplus(decay_pre)).sum(0)
