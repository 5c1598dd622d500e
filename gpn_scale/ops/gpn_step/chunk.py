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
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from gpn_scale.ops.gpn_step import fused as _fused
from gpn_scale.ops.gpn_step.collectives import tp_sum_
from gpn_scale.ops.gpn_step.functional import accumulate_mm, matmul_copy_dtype
from gpn_scale.ops.gpn_step.functional import mm_t as _mm_t
from gpn_scale.ops.gpn_step.functional import rms_back as _rms_back
from gpn_scale.ops.gpn_step.interface import (
    ChunkActs,
    ChunkForward,
    LoopWeights,
    ReverseSweep,
    StepBackend,
    StepPlan,
    SweepAdjoints,
    memory_reads,
    read_values,
)
from gpn_scale.ops.gpn_step.overlap import Future, side_work
from gpn_scale.ops.gpn_step.phases import phase as _phase
from gpn_scale.ops.gpn_step.recompute import recompute_chunk
from gpn_scale.ops.gpn_step.registry import select_backend
from gpn_scale.ops.gpn_step.workspace import Workspace, workspaces
from gpn_scale.ops.memory import chunk_advance

Carry = tuple[Tensor, Tensor, "Tensor | None"]  # (s, s_prev, M): M is None without memory
ChunkHook = Callable[[Tensor, int, int], None]  # (P, start, end) once P[:, start:end] is made


# --------------------------------------------------------------------- backward
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
    workspace: Workspace,
) -> tuple[tuple[Tensor, Tensor, Tensor | None], SweepAdjoints, Tensor | None]:
    """One chunk's backward: the hand-written reverse sweep over its steps, then the
    gradients of the chunk's start carry (s, s_prev, M0). M0 is the carry; the sweep reads
    it as `memory_reads` gives it, and the gradient of those reads is M0's (the rounding of
    `engine.bf16_memory_reads` passes gradients unchanged).

    The per-step work is the inherent input-gradient matmuls (dy @ W^T, few rows) and cheap
    elementwise/memory terms (the step backend's `reverse_sweep`); the activations come from
    `recompute.recompute_chunk`. Returns the start carry's gradients, the adjoints and dk_pre0, from
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
            plan,
            Wt,
            ReverseSweep(acts, memory_reads(plan, M0), dP, ds_end, ds_prev_end, adjoints),
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
    workspace: Workspace,
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
    step_major = (C, *U.shape[:2], U.shape[3])  # (C, B, H, dv), see _step_major_view
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
        dG[..., -1] += wt.sum(-1) + G_end[..., 0].exp() * _frobenius(dM_end, M0)
        dM0 = G_end[..., 0].exp()[..., None, None] * dM_end  # outlives the chunk
    else:
        dM0 = torch.zeros_like(M0)
    return SweepAdjoints(dY, dZ, dYfg, d_fuse, dK, dU, dG, dRk, dRq, dA), dM0


def _frobenius(x: Tensor, y: Tensor) -> Tensor:
    """sum(x * y) over the last two dims, as one GEMM per matrix pair: the elementwise
    product would be written and read again (M0's size, 252 MB a chunk at 130M, B = 128)."""
    lead, n = x.shape[:-2], x.shape[-2] * x.shape[-1]
    return torch.bmm(x.reshape(-1, 1, n), y.reshape(-1, n, 1)).view(lead)


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
    # dM0 += k^T dRk + sum_i q_i^T dRq_i, each product added by its GEMM (beta = 1): a
    # product the size of M0 written and added after would move it three times more.
    flat = dM0.view(-1, *dM0.shape[-2:])
    flat.baddbmm_(m.k.mT.flatten(0, 1), madj.dRk.flatten(0, 1))
    for i in range(plan.n_layers):
        flat.baddbmm_(m.q[i].mT.flatten(0, 1), adj.dRq[i].flatten(0, 1))
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
        n = acts.n_low[i] if acts.n_low else acts.n[i]  # the GEMM's operand
        dY = _with_bias_grad(rows(adj.dY[i]), grads.b_in[i], mm)
        accumulate_mm(grads.w_in[i], rows(n).t(), dY, mm)
        accumulate_mm(grads.w_out[i], rows(acts.hidden[i]).t(), rows(adj.dZ[i]), mm)
    n_p = acts.n_p_low if acts.n_p_low is not None else acts.n_p
    accumulate_mm(grads.w_fg, rows(n_p).t(), _with_bias_grad(rows(adj.dYfg), grads.b_fg, mm), mm)
    if not plan.memory:
        return
    assert dk_pre0 is not None and grads.A is not None and acts.n_sprev is not None
    assert adj.dA is not None
    k_cols = plan.H * plan.dk  # the chunk's first key came from s_prev
    accumulate_mm(grads.w_in[0][:, :k_cols], acts.n_sprev.t(), dk_pre0, mm)
    grads.b_in[0][:k_cols] += dk_pre0.sum(0)
    grads.A += adj.dA


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
                    memory_reads(plan, M),
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
    sets = workspaces(longest, device)
    reading: list[Future[None] | None] = [None, None]  # the weight gradients on each set

    def recompute(idx: int) -> ChunkActs:
        start, end = plan.spans[idx]
        _, s_prev, M = ctx.carries[idx]
        with _phase("parallel recompute", device):
            # the values the forward's steps read (its GEMMs take them in the state dtype)
            reads = read_values(memory_reads(plan, M), S)
            return recompute_chunk(plan, Wrec, S[:, start:end], s_prev, reads, sets[idx % 2])

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
            sets[buffers],
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


def _with_bias_grad(dy: Tensor, db: Tensor, mm: torch.dtype | None) -> Tensor:
    """db += dy's column sums; returns the weight gradient's operand: on the GPU path under
    autocast dy in the matmul dtype, made in the same pass (`fused.cast_with_sums`)."""
    low = matmul_copy_dtype(dy, mm)
    if low is None:
        db += dy.sum(0)
        return dy
    return _fused.cast_with_sums(dy, torch.empty(dy.shape, dtype=low, device=dy.device), db)


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
