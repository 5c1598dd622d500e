"""The GPN / GPN+M sequence op: one window, chunk by chunk, forward and backward.

`gpn_sequence(plan, fuse, carry, weights)` takes the plan (widths, chunk spans, dtype, step
backend, tp group), the fused inputs of every position (B, T, d), the carry entering the
window (s, s_prev, M) and the loop's fused weights (`LoopWeights`, which the model folds from
its parameters), and returns every step's output P (B, T, d) and the final carry. It is one
autograd function:

- forward: no grad, chunk by chunk on the step backend (`registry.select_backend`: the
  PyTorch steps, fused C++ on CPU, Triton on CUDA); the memory stays in chunk form
  (`ops/memory.py`) and advances once per chunk. It keeps the states entering each step
  (O(T*d)) and one carry per chunk;
- backward: chunk by chunk in reverse. Per chunk it first recomputes every activation in
  parallel (C*B-row matmuls and the fully parallel chunk memory form: no step loop), pushes
  the end memory's gradient onto the chunk's keys, errors and decays, runs the backend's
  hand-written reverse sweep (whose only per-step matmuls are the inherent dy @ W^T), then
  forms every weight gradient (and dM0) as one matmul over the chunk. Chunks end at every
  truncated-BPTT cut too, where nothing flows back.

Held equal to autograd through the step-by-step reference model by the tests
(tests/models/gpn/test_engine.py, tests/ops/test_gpn_step.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from gpn_scale.ops.gpn_step.collectives import reduce_rows, rms_wide, tp_sum_
from gpn_scale.ops.gpn_step.functional import accumulate_mm
from gpn_scale.ops.gpn_step.functional import l2n as _l2n
from gpn_scale.ops.gpn_step.functional import matmul as _matmul
from gpn_scale.ops.gpn_step.functional import mm_t as _mm_t
from gpn_scale.ops.gpn_step.functional import rms as _rms
from gpn_scale.ops.gpn_step.functional import rms_back as _rms_back
from gpn_scale.ops.gpn_step.interface import (
    ChunkActs,
    ChunkForward,
    LoopWeights,
    ReverseSweep,
    StepBackend,
    StepPlan,
    SweepAdjoints,
)
from gpn_scale.ops.gpn_step.overlap import Future, side_work
from gpn_scale.ops.gpn_step.phases import phase as _phase
from gpn_scale.ops.gpn_step.registry import select_backend
from gpn_scale.ops.memory import chunk_advance, chunk_errors, chunk_read

Carry = tuple[Tensor, Tensor, "Tensor | None"]  # (s, s_prev, M): M is None without memory
ChunkHook = Callable[[Tensor, int, int], None]  # (P, start, end) once P[:, start:end] is made


# --------------------------------------------------------------------- backward
@torch.no_grad()
def _recompute_chunk(
    plan: StepPlan,
    W: LoopWeights,
    S: Tensor,
    s_prev: Tensor,
    M0: Tensor | None,
    ws: _Workspace,
) -> ChunkActs:
    """Given the states S (B, C, d) entering each step, the whole chunk at once.

    Every projection is ONE (C*B)-row matmul and the memory is the fully parallel chunk
    form (`ops.memory`, use 1): no few-row matmul, no step loop. Every activation the reverse
    sweep reads is written by the op that makes it into the workspace `ws` (one of the two
    the chunks alternate between): the reverse graphs bind them by address
    (`ChunkActs.BOUND`), so a replay copies none of them in (~2.8 GB a chunk at 130M and
    B = 128).
    """
    B, C, d = S.shape
    H, dk, dv, eps = plan.H, plan.dk, plan.dv, plan.eps
    mem = plan.memory
    if mem:  # GPN+M: the decay rates and the chunk-start memory are given
        assert W.A is not None and M0 is not None
        A, M = W.A, M0

    def kept(name: str, shape: tuple[int, ...], chunk_dim: int | None = 0) -> Tensor:
        return ws.compact(f"act.{name}", shape, chunk_dim, S.dtype)

    # torch.split takes any sequence of sizes (its stub says list).
    splits = cast("tuple[list[int], ...]", plan.in_splits)
    c = kept("c0", (C, B, d)).copy_(S.transpose(0, 1))
    cs: list[Tensor] = []
    ns: list[Tensor] = []
    ys: list[Tensor] = []
    hiddens: list[Tensor] = []
    o_s: list[Tensor | None] = []
    ro_s: list[Tensor | None] = []
    q_s: list[Tensor | None] = []
    rq_s: list[Tensor | None] = []
    for i in range(plan.n_layers):
        n = _rms(c, eps, kept(f"n{i}", (C, B, d)))
        y = _matmul(n, W.w_in[i], W.b_in[i], kept(f"y{i}", (C, B, W.w_in[i].shape[1])))
        cs.append(c)
        ns.append(n)
        ys.append(y)
        parts = torch.split(y, splits[i], dim=-1)
        if mem and i == 0:
            k_next_pre, v_pre, beta_pre, decay_pre, q_pre, rg, ffn_in, pg = parts
            k_cols = H * dk
            n_sprev = _rms(s_prev, eps, kept("n_sprev", tuple(s_prev.shape), None))
            k_first = _matmul(n_sprev, W.w_in[0][:, :k_cols], W.b_in[0][:k_cols])
            k_pre = torch.cat(
                [k_first[None], k_next_pre[:-1]], 0, out=kept("k_pre", (C, B, k_cols))
            )
            K = _heads(_l2n(F.relu(k_pre).view(C, B, H, dk), kept("k", (C, B, H, dk))))
            V = _heads(v_pre.reshape(C, B, H, dv))  # a view of y
            log_a = (-A * F.softplus(decay_pre)).permute(1, 2, 0)  # (B, H, C)
            beta = torch.sigmoid(beta_pre, out=kept("beta", (C, B, H))).permute(1, 2, 0)
            U, G = chunk_errors(K, V, log_a, beta, M, "gpn")
            # (the solve returns U column-major; the sweep reads rows)
            U = kept("U", tuple(U.shape), 2).copy_(U)
            G = kept("G", tuple(G.shape), 2).copy_(G)
            rk = _step_major(K @ M, kept("rk", (C, B, H, dv)))
            pred = _step_major(_prediction(K, U, G, rk), kept("pred", (C, B, H, dv)))
        elif mem:
            q_pre, rg, ffn_in, pg = parts
        else:
            ffn_in, pg = parts
        a, b = ffn_in.chunk(2, dim=-1)
        hidden = F.silu(a) * b
        if mem:
            q = _heads(_l2n(F.relu(q_pre).view(C, B, H, dk), kept(f"q{i}", (C, B, H, dk))))
            qM = q @ M  # once: the read below and the sweep (as rq) both need it
            rq = _step_major(qM, kept(f"rq{i}", (C, B, H, dv)))
            o = kept(f"o{i}", (C, B, H * dv))
            o.view(C, B, H, dv).copy_(chunk_read(q, K, U, G, M, qM).permute(2, 0, 1, 3))
            ro = rms_wide(o, eps, plan, kept(f"ro{i}", (C, B, H * dv)))
            hidden = torch.cat([F.silu(rg) * ro, hidden], dim=-1)
            q_s.append(q)
            rq_s.append(rq)
            o_s.append(o)
            ro_s.append(ro)
        else:
            q_s.append(None)
            rq_s.append(None)
            o_s.append(None)
            ro_s.append(None)
        hiddens.append(hidden)  # read by the weight gradients only: not kept
        z = reduce_rows(_matmul(hidden, W.w_out[i], None), plan)
        c = torch.add(torch.sigmoid(pg) * c, z, out=kept(f"c{i + 1}", (C, B, d)))
    n_p = _rms(c, eps, kept("n_p", (C, B, d)))
    gate = _matmul(n_p, W.w_fg, W.b_fg, kept("gate", (C, B, d))).sigmoid_()
    acts = ChunkActs(cs, ns, ys, hiddens, o_s, ro_s, q_s, rq_s, n_p, gate, c)
    if mem:
        acts.s_prev, acts.n_sprev, acts.k_pre, acts.k, acts.v = s_prev, n_sprev, k_pre, K, V
        acts.beta, acts.U, acts.G, acts.pred, acts.rk = beta, U, G, pred, rk
    return acts


def _prediction(K: Tensor, U: Tensor, G: Tensor, rk: Tensor) -> Tensor:
    """M_{t-1}^T k_t for every step (rk = M0^T k_t):
    e^{G_{t-1}} M0^T k_t + sum_{j<t} e^{G_{t-1}-G_j}(k_t.k_j) u_j."""
    G_prev = torch.cat([torch.zeros_like(G[..., :1]), G[..., :-1]], dim=-1)
    C = G.shape[-1]
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=G.device), diagonal=-1)
    expo = torch.where(strict, G_prev[..., :, None] - G[..., None, :], float("-inf"))
    return G_prev.exp()[..., None] * rk + ((K @ K.mT) * expo.exp()) @ U


def _step_major(x: Tensor, out: Tensor) -> Tensor:
    """(B, H, C, n) -> the same values as a (B, H, C, n) view of `out`, a (C, B, H, n) buffer:
    the reverse sweep reads these one step at a time, and a step's rows for every head and
    batch row then lie together (prefetchable) instead of C*n apart."""
    return out.copy_(x.permute(2, 0, 1, 3)).permute(1, 2, 0, 3)


def _heads(x: Tensor) -> Tensor:
    """(C, B, H, n) -> (B, H, C, n)."""
    return x.permute(1, 2, 0, 3)


@dataclass
class _Grads:
    """Weight-gradient accumulators of the whole window (float32 or float64)."""

    w_in: list[Tensor]
    b_in: list[Tensor]
    w_out: list[Tensor]
    w_fg: Tensor
    b_fg: Tensor
    A: Tensor | None

    @staticmethod
    def zeros_like(W: LoopWeights, dtype: torch.dtype) -> _Grads:
        z = lambda t: torch.zeros(t.shape, dtype=dtype, device=t.device)  # noqa: E731
        return _Grads(
            [z(w) for w in W.w_in],
            [z(b) for b in W.b_in],
            [z(w) for w in W.w_out],
            z(W.w_fg),
            z(W.b_fg),
            None if W.A is None else z(W.A),
        )

    def flat(self) -> list[Tensor]:
        return [
            *self.w_in,
            *self.b_in,
            *self.w_out,
            self.w_fg,
            self.b_fg,
            *([self.A] if self.A is not None else []),
        ]


def _chunk_backward(
    plan: StepPlan,
    Wt: LoopWeights,
    acts: ChunkActs,
    M0: Tensor | None,
    dP: Tensor,
    ds_end: Tensor | None,
    ds_prev_end: Tensor | None,
    dM_end: Tensor | None,
    d_fuse: Tensor,
    backend: StepBackend,
    workspace: _Workspace,
) -> tuple[tuple[Tensor, Tensor, Tensor | None], SweepAdjoints, Tensor | None]:
    """One chunk's backward: the hand-written reverse sweep over its steps, then the
    gradients of the chunk's start carry (s, s_prev, M0).

    The per-step work is the inherent input-gradient matmuls (dy @ W^T, few rows) and cheap
    elementwise/memory terms (the step backend's `reverse_sweep`); the activations come from
    `_recompute_chunk`. Returns the start carry's gradients, the adjoints and dk_pre0, from
    which `_chunk_weight_gradients` forms every weight gradient as one matmul over the chunk
    (beside the next chunk's sweep, overlap.py).
    """
    # Pushing the end memory's gradient onto the chunk's k, u and G is chunk-wide GEMM work
    # (like the recompute), timed apart from the sequential sweep that follows it.
    device = dP.device
    with _phase("memory carry backward", device):
        adjoints, dM0 = _sweep_adjoints(
            plan, Wt, acts, M0, dP, dM_end, d_fuse, workspace, backend.matmul_only_adjoints
        )
    with _phase("sequential backward", device):
        result = backend.reverse_sweep(
            plan, Wt, ReverseSweep(acts, M0, dP, ds_end, ds_prev_end, adjoints)
        )
    with _phase("memory carry backward", device):
        carry = _start_carry_gradients(
            plan, Wt, acts, result.ds_start, adjoints, result.dk_pre0, dM0
        )
    return carry, adjoints, result.dk_pre0


def _sweep_adjoints(
    plan: StepPlan,
    Wt: LoopWeights,
    acts: ChunkActs,
    M0: Tensor | None,
    dP: Tensor,
    dM_end: Tensor | None,
    d_fuse: Tensor,
    workspace: _Workspace,
    matmul_only: tuple[str, ...] = (),
) -> tuple[SweepAdjoints, Tensor | None]:
    """The adjoint buffers the reverse sweep accumulates into, with the end-of-chunk
    memory's gradient already pushed onto k, u and G; and the (partial) dM0. `matmul_only`:
    those the backend writes in the matmul dtype (`StepBackend.matmul_only_adjoints`)."""
    C, B, d = acts.p.shape
    L = plan.n_layers
    mem = plan.memory
    dt = dP.dtype
    ws = workspace
    # Written whole at every step (no zero fill needed); the memory adjoints accumulate.
    dY = [ws.take(f"dY{i}", y.shape, 0, dt) for i, y in enumerate(acts.y)]
    dt_z = plan.mm_dtype if "dZ" in matmul_only and plan.mm_dtype is not None else dt
    dZ = [ws.take(f"dZ{i}", (C, B, d), 0, dt_z) for i in range(L)]
    dYfg = ws.take("dYfg", (C, B, d), 0, dt)
    if not mem:
        return SweepAdjoints(dY, dZ, dYfg, d_fuse, None, None, None, None, [], None), None
    K, U, G = acts.k, acts.U, acts.G
    assert K is not None and U is not None and G is not None  # GPN+M
    assert Wt.A is not None and M0 is not None
    pushed = dM_end is not None  # the chunk's last one has no later memory
    # dK, dU, dG start as the end memory's share (written in place, no zero fill first).
    dK = ws.take("dK", K.shape, 2, dt, zero=not pushed)
    dU = ws.take("dU", U.shape, 2, dt, zero=not pushed)
    dG = ws.take("dG", G.shape, 2, dt, zero=not pushed)
    step_major = (C, *U.shape[:2], U.shape[3])  # (C, B, H, dv), see _step_major
    dRk = ws.take("dRk", step_major, 0, dt).permute(1, 2, 0, 3)
    dRq = [ws.take(f"dRq{i}", step_major, 0, dt).permute(1, 2, 0, 3) for i in range(L)]
    dA = torch.zeros_like(Wt.A)
    if dM_end is not None:  # pushed: M_C = e^{G_C} M0 + sum_j w_j k_j u_j^T
        G_end = G[..., -1:]
        w = (G_end - G).exp()
        KdM = K @ dM_end
        torch.mul(U @ dM_end.mT, w[..., None], out=dK)
        torch.mul(KdM, w[..., None], out=dU)
        wt = w * (KdM * U).sum(-1)
        torch.neg(wt, out=dG)
        dG[..., -1] += wt.sum(-1) + G_end[..., 0].exp() * (dM_end * M0).sum((-2, -1))
        dM0 = G_end[..., 0].exp()[..., None, None] * dM_end  # outlives the chunk
    else:
        dM0 = torch.zeros_like(M0)
    return SweepAdjoints(dY, dZ, dYfg, d_fuse, dK, dU, dG, dRk, dRq, dA), dM0


def _start_carry_gradients(
    plan: StepPlan,
    Wt: LoopWeights,
    acts: ChunkActs,
    dg: Tensor,
    adj: SweepAdjoints,
    dk_pre0: Tensor | None,
    dM0: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The gradients of the chunk's start carry (s, s_prev, M0): what the previous chunk's
    sweep waits for (the weight gradients are not)."""
    if not plan.memory:
        return dg, torch.zeros_like(dg), None
    m, madj = acts.memory(), adj.memory()
    assert dk_pre0 is not None and dM0 is not None  # GPN+M
    # The chunk's first key came from s_prev. The keys are all sharded under tensor
    # parallelism: their input gradient is summed.
    k_cols = plan.H * plan.dk
    dn_sprev = tp_sum_(_mm_t(dk_pre0, Wt.w_in[0][:k_cols]), plan)
    dsprev_start = _rms_back(m.n_sprev, m.s_prev, dn_sprev, plan.eps)
    dM0 = dM0 + m.k.mT @ madj.dRk
    for i in range(plan.n_layers):
        dM0 = dM0 + m.q[i].mT @ adj.dRq[i]
    return dg, dsprev_start, dM0


def _chunk_weight_gradients(
    plan: StepPlan, acts: ChunkActs, adj: SweepAdjoints, dk_pre0: Tensor | None, grads: _Grads
) -> None:
    """Every weight gradient of the chunk as one matmul over its C*B rows (never a rank-B
    update per step), added to `grads` in a fixed order (the same with overlap or without)."""
    C, B, _ = acts.p.shape
    L = plan.n_layers
    rows = lambda t: t.reshape(C * B, -1)  # noqa: E731
    # Accumulated in place (GEMM with beta = 1): a product the size of the weights, added
    # afterwards, would be written and read once more per chunk.
    # Under autocast on CUDA the operands go in bf16 with fp32 accumulation (tensor cores;
    # these GEMMs are ~26% of the counted FLOPs), elsewhere in the state dtype.
    mm = plan.mm_dtype
    for i in range(L):
        accumulate_mm(grads.w_in[i], rows(acts.n[i]).t(), rows(adj.dY[i]), mm)
        grads.b_in[i] += rows(adj.dY[i]).sum(0)
        accumulate_mm(grads.w_out[i], rows(acts.hidden[i]).t(), rows(adj.dZ[i]), mm)
    accumulate_mm(grads.w_fg, rows(acts.n_p).t(), rows(adj.dYfg), mm)
    grads.b_fg += rows(adj.dYfg).sum(0)
    if not plan.memory:
        return
    assert dk_pre0 is not None and grads.A is not None and acts.n_sprev is not None
    assert adj.dA is not None
    k_cols = plan.H * plan.dk  # the chunk's first key came from s_prev
    accumulate_mm(grads.w_in[0][:, :k_cols], acts.n_sprev.t(), dk_pre0, mm)
    grads.b_in[0][:k_cols] += dk_pre0.sum(0)
    grads.A += adj.dA


class _Workspace:
    """The sweep's adjoint buffers, reused from chunk to chunk and call to call (`_workspaces`).
    Fresh allocations of this size come straight from mmap, and first-touching their pages
    cost ~15 us per step at SMALL (measured): the sweep writes ~7 MB of adjoints per chunk;
    and the CUDA graphs bind the buffers by address."""

    def __init__(self, max_chunk: int, device: torch.device) -> None:
        self.max_chunk = max_chunk
        self.device = device
        self._buffers: dict[str, Tensor] = {}

    def compact(
        self, name: str, shape: tuple[int, ...], chunk_dim: int | None, dtype: torch.dtype
    ) -> Tensor:
        """A contiguous (possibly uninitialised) tensor of `shape` at the start of a flat
        buffer sized for the longest chunk (`chunk_dim`: the dim that is the chunk's length;
        None: none is), so a chunk of any length finds it at the same address."""
        numel = math.prod(shape)
        full = numel if chunk_dim is None else numel // shape[chunk_dim] * self.max_chunk
        buf = self._buffers.get(name)
        if buf is None or buf.numel() != full or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(full, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)

    def take(
        self,
        name: str,
        shape: tuple[int, ...],
        chunk_dim: int,
        dtype: torch.dtype,
        zero: bool = False,
    ) -> Tensor:
        """A (possibly uninitialised) tensor of `shape`, whose dim `chunk_dim` is the chunk's
        length, viewed out of a buffer sized for the longest chunk."""
        full = list(shape)
        full[chunk_dim] = self.max_chunk
        buf = self._buffers.get(name)
        if buf is None or list(buf.shape) != full or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(full, dtype=dtype, device=self.device)
        view = buf.narrow(chunk_dim, 0, shape[chunk_dim])
        return view.zero_() if zero else view


# The sweep's two adjoint workspaces per device, kept from call to call: the CUDA graphs
# bind their buffers by address (graphs.py, `SweepAdjoints.BOUND`), so a replay copies no
# adjoint in or out. A call of another longest chunk replaces them: a view out of a longer
# buffer would have other strides than a fresh one, and the kernels' compiled variants
# (which specialise on strides) would depend on what ran before.
_WORKSPACES: dict[torch.device, tuple[_Workspace, _Workspace]] = {}


def release_workspaces() -> None:
    """Drop the kept adjoint workspaces (between models: the device check measures each
    model's peak memory without the last one's)."""
    _WORKSPACES.clear()


def _workspaces(longest: int, device: torch.device) -> tuple[_Workspace, _Workspace]:
    pair = _WORKSPACES.get(device)
    if pair is None or pair[0].max_chunk != longest:
        pair = _WORKSPACES[device] = (_Workspace(longest, device), _Workspace(longest, device))
    return pair


def _forward_chunks(
    plan: StepPlan,
    W: LoopWeights,
    backend: StepBackend,
    fuse: Tensor,
    s: Tensor,
    s_prev: Tensor,
    M: Tensor | None,
    P: Tensor,
    S: Tensor | None,
    carries: list,
    on_chunk: ChunkHook | None,
) -> None:
    """The no-grad forward over all chunks; appends each chunk's start carry to `carries`
    (and, last, the final carry); fills P and, when given, S (the state entering each step).
    `on_chunk(P, start, end)` runs after each chunk's steps, outside their phase (the caller's
    work on the chunk's outputs: the engine's decode, beside the next chunk on CUDA)."""
    for start, end in plan.spans:
        carries.append((s, s_prev, M))
        with _phase("sequential forward", fuse.device):
            out = backend.forward_chunk(
                plan,
                W,
                ChunkForward(
                    fuse[:, start:end],
                    s,
                    s_prev,
                    M,
                    P[:, start:end],
                    None if S is None else S[:, start:end],
                ),
            )
            s, s_prev = out.s, out.s_prev
            if plan.memory:
                assert (
                    out.K is not None and out.U is not None and out.G is not None and M is not None
                )
                M = chunk_advance(out.K, out.U, out.G, M)
        if on_chunk is not None:
            on_chunk(P, start, end)
    carries.append((s, s_prev, M))


def _backward_chunks(
    ctx,
    plan: StepPlan,
    Wt: LoopWeights,
    Wrec: LoopWeights,
    S: Tensor,
    dP: Tensor,
    d_carry: tuple[Tensor | None, Tensor | None, Tensor | None],
    grads: _Grads,
    d_fuse: Tensor,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The chunks in reverse, to the gradients of the window's start carry.

    The chunk-wide work runs as side work (overlap.py): the next chunk's recompute beside this
    chunk's sweep, this chunk's weight gradients beside the next one's. A chunk's activations
    and adjoints live in buffer set k % 2, so the sweep of chunk k-1 never writes what the
    weight gradients of chunk k still read; a set is reused once its weight gradients are
    done. The recompute of chunk k-1 writes the set that chunk k+1's weight gradients read:
    it is submitted after them to the same in-order side work, so runs once they are done."""
    device = dP.device
    side = side_work(device, plan.options.overlap_backward)
    longest = max(end - start for start, end in plan.spans)
    workspaces = _workspaces(longest, device)
    reading: list[Future[None] | None] = [None, None]  # the weight gradients on each set

    def recompute(idx: int) -> ChunkActs:
        start, end = plan.spans[idx]
        _, s_prev, M = ctx.carries[idx]
        with _phase("parallel recompute", device):
            return _recompute_chunk(plan, Wrec, S[:, start:end], s_prev, M, workspaces[idx % 2])

    last = len(plan.spans) - 1
    recomputed = side.submit(lambda: recompute(last), after=side.mark())
    for idx in range(last, -1, -1):
        start, end = plan.spans[idx]
        if end in plan.cuts:  # truncated BPTT: nothing flows back across this point
            d_carry = (None, None, None)
        acts = side.get(recomputed, ChunkActs.tensors)
        if idx > 0:
            recomputed = side.submit(functools.partial(recompute, idx - 1))
        buffers = idx % 2
        pending = reading[buffers]
        if pending is not None:
            side.get(pending)
        d_carry, adj, dk_pre0 = _chunk_backward(
            plan,
            Wt,
            acts,
            ctx.carries[idx][2],
            dP[:, start:end],
            *d_carry,
            d_fuse[:, start:end],
            ctx.backend,
            workspaces[buffers],
        )
        reading[buffers] = side.submit(
            functools.partial(_weight_gradients, plan, acts, adj, dk_pre0, grads),
            after=side.mark(),
            reads=[t for t in (dk_pre0, adj.dA) if t is not None],
        )
    side.join()
    return d_carry


def _weight_gradients(
    plan: StepPlan, acts: ChunkActs, adj: SweepAdjoints, dk_pre0: Tensor | None, grads: _Grads
) -> None:
    with _phase("weight gradients", acts.p.device):
        _chunk_weight_gradients(plan, acts, adj, dk_pre0, grads)


class _SequenceFunction(torch.autograd.Function):
    """fuse (B, T, d), initial carry, loop weights -> P (B, T, d), final carry."""

    @staticmethod
    def forward(
        ctx,
        plan: StepPlan,
        fuse: Tensor,
        s0: Tensor,
        s_prev0: Tensor,
        M0: Tensor | None,
        on_chunk: ChunkHook | None,
        *flat: Tensor,
    ):
        backend = select_backend(plan.options.step_backend, fuse.device, plan.tp_size)
        W = LoopWeights.unflat(plan, flat).for_matmul(plan.mm_dtype, backend.row_alignment)
        B, T, d = fuse.shape
        P = fuse.new_empty(B, T, d)
        # The state entering each step, O(T*d): what the backward recomputes each chunk from.
        S = fuse.new_empty(B, T, d) if any(ctx.needs_input_grad) else None
        carries: list = []
        _forward_chunks(plan, W, backend, fuse, s0, s_prev0, M0, P, S, carries, on_chunk)
        s, s_prev, M = carries.pop()
        ctx.plan = plan
        ctx.backend = backend
        ctx.carries = carries
        ctx.fuse_meta = (fuse.shape, fuse.dtype, fuse.device)  # its values are not needed
        ctx.save_for_backward(S, *flat)
        if M is None:
            M = fuse.new_zeros(0)
            ctx.mark_non_differentiable(M)
        return P, s, s_prev, M

    @staticmethod
    def backward(ctx, dP: Tensor, ds: Tensor, ds_prev: Tensor, dM: Tensor):
        plan: StepPlan = ctx.plan
        dP = dP.contiguous()
        S, *flat = ctx.saved_tensors
        shape, dtype, device = ctx.fuse_meta
        W = LoopWeights.unflat(plan, [t.detach() for t in flat])
        Wt = W.for_matmul(plan.mm_dtype).transposed(ctx.backend.row_alignment)
        # The recompute reads the same copies as the sweep, as views (its chunk-wide GEMMs run
        # as fast on them): the backward streams one copy of the loop weights instead of two,
        # and the sweep's first steps of each chunk find more of them still in cache.
        Wrec = Wt.untransposed_views()
        grads = _Grads.zeros_like(W, dtype)
        d_fuse = torch.empty(shape, dtype=dtype, device=device)
        d_carry: tuple[Tensor | None, Tensor | None, Tensor | None] = (
            ds,
            ds_prev,
            dM if plan.memory else None,
        )
        d_carry = _backward_chunks(ctx, plan, Wt, Wrec, S, dP, d_carry, grads, d_fuse)
        weight_grads = [g.to(w.dtype) for g, w in zip(grads.flat(), flat)]
        ds0, ds_prev0, dM0 = d_carry
        return (
            None,
            d_fuse,
            ds0,
            ds_prev0,
            dM0 if ctx.needs_input_grad[4] else None,
            None,
            *weight_grads,
        )


# ------------------------------------------------------------------ entry point
def make_spans(
    T: int, chunk_size: int, tbptt: int
) -> tuple[tuple[tuple[int, int], ...], frozenset[int]]:
    """Chunk boundaries every `chunk_size` steps, and also at every truncation point."""
    cuts = frozenset(range(tbptt, T, tbptt)) if tbptt else frozenset()
    bounds = sorted(set(range(0, T, chunk_size)) | cuts | {T})
    return tuple(zip(bounds[:-1], bounds[1:])), cuts


def gpn_sequence(
    plan: StepPlan,
    fuse: Tensor,
    carry: Carry,
    weights: LoopWeights,
    on_chunk: ChunkHook | None = None,
) -> tuple[Tensor, Carry]:
    """(P (B, T, d), the final carry) of one window: see the module docstring. `on_chunk(P,
    start, end)`: called in the forward once P[:, start:end] is made (it must not write P)."""
    s0, s_prev0, M0 = carry
    P, s, s_prev, M = _SequenceFunction.apply(
        plan, fuse, s0, s_prev0, M0, on_chunk, *weights.flat()
    )
    return P, (s, s_prev, M if plan.memory else None)
