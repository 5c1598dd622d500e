"""The CUDA step backend's reverse sweep: each time step's launches in reverse (the fuse
gate's and the down-projection's input gradients, the row kernels, the read norm's sums, ONE
memory/FFN kernel and the deferred pushes of the chunk's history in blocks), and what each
moves for the accounting. `cuda.py` says what each launch does and how many a step takes; a
CUDA graph captures this function (`graphs.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from gpn_scale.ops.gpn_step import geometry
from gpn_scale.ops.gpn_step import triton_kernels as tk
from gpn_scale.ops.gpn_step.cuda_shared import (
    FLUSH_MAXNREG,
    FLUSH_SETTINGS,
    MEMORY_BACKWARD_BLOCK_DV,
    MEMORY_BACKWARD_MAXNREG,
    MEMORY_BACKWARD_STAGES,
    MEMORY_BACKWARD_WARPS,
    ROW_BLOCK,
    ROW_WARPS,
    SWEEP_BLOCK,
    ffn_programs,
    layer_meta,
    mem_blocks,
    pointers,
    side_work_queue,
    splits_over_tp,
    tp_sum,
)
from gpn_scale.ops.gpn_step.gemm import SplitWorkspace, linear
from gpn_scale.ops.gpn_step.interface import (
    LoopWeights,
    ReverseSweep,
    ReverseSweepResult,
    StepPlan,
)
from gpn_scale.ops.launch import launch as _launch
from gpn_scale.ops.launch import nbytes as _nbytes
from gpn_scale.ops.launch import record_aten as _aten


def reverse_sweep_eager(plan: StepPlan, Wt: LoopWeights, sweep: ReverseSweep) -> ReverseSweepResult:
    """The chunk's reverse sweep as launches (what a graph captures)."""
    acts, a, dP = sweep.acts, sweep.adjoints, sweep.dP
    C, B, d = acts.p.shape
    H, dv, f, L, eps = plan.H, plan.dv, plan.f, plan.n_layers, plan.eps
    mem = plan.memory
    new = lambda *shape: dP.new_empty(shape)  # noqa: E731
    ph, pc = "reverse step", "reverse chunk"
    DG, DN, DCIN = new(B, d), new(B, d), new(B, d)
    DH = new(B, H * dv + f)
    ws = SplitWorkspace(dP, plan.options.cublas_projections())
    blocks = mem_blocks(plan, dP, C)
    grid_mem = (B, (H if mem else 0) + ffn_programs(plan, blocks["BLOCK_F"]))
    BD = min(geometry.p2(d), 16 if geometry.interpreting(dP) else ROW_BLOCK)
    split = splits_over_tp(plan)
    DNP = new(B, d) if split else None  # the sharded blocks' dY W^T before its sum
    # GPN+M: the read norm backward's (B, 2) row sums, once per row (and under tp summed over
    # the group) before the memory kernel, instead of again by each of its H head programs.
    SUMS = new(B, 2) if mem else None
    ds_end = sweep.ds_end.contiguous() if sweep.ds_end is not None else None
    extra = sweep.ds_prev_end.contiguous() if sweep.ds_prev_end is not None else None
    _launch(
        tk.rev_start_kernel,
        (B,),
        "reverse start",
        pc,
        5 * _nbytes(DG),
        0,
        ds_end if ds_end is not None else DG,
        DG,
        a.d_fuse[:, C - 1],
        a.d_fuse.stride(0),
        acts.p[C - 1],
        acts.gate[C - 1],
        a.dYfg[C - 1],
        d,
        HAS_DS=ds_end is not None,
        BLOCK_D=BD,
        num_warps=ROW_WARPS,
        **geometry.dependent_launch(dP),
    )
    mb = _sweep_memory(plan, sweep, pc) if mem else _SweepMemory.none(L)
    for tau in range(C - 1, -1, -1):
        # each dY W^T's split-K partials are summed by the row kernel that reads them
        parts = linear(
            a.dYfg[tau],
            Wt.w_fg,
            DN,
            ph,
            "fuse-gate dy W^T",
            workspace=ws,
            sum_in_consumer=True,
            projection="fuse_gate_dx",
        )
        _rev_row(plan, L - 1, tau, DN, acts.n_p[tau], acts.p[tau], dP[:, tau], acts, a, DG,
                 DCIN, None, BD, ground=True, dn_parts=parts)  # fmt: skip
        for i in range(L - 1, -1, -1):
            linear(a.dZ[i][tau], Wt.w_out[i], DH, ph, f"down dy W^T {i}", workspace=ws,
                   projection="down_dx")  # fmt: skip
            if SUMS is not None:
                _read_norm_sums(plan, i, tau, acts, DH, SUMS, blocks)
            _memory_backward(plan, i, tau, C, acts, a, DH, mb, Wt.A, grid_mem, blocks, eps, SUMS)
            parts = _input_grad(plan, i, a.dY[i][tau], Wt.w_in[i], DNP, DN, ws)
            _rev_row(plan, i - 1, tau, DN, acts.n[i][tau], acts.c[i][tau], DCIN, acts, a, DG, DCIN,
                     extra if tau == C - 1 and i == 0 else None, BD, ground=False,
                     dn_parts=parts)  # fmt: skip
    if mem:
        assert a.dA is not None and mb.DA_ROWS is not None  # GPN+M
        a.dA += mb.DA_ROWS.sum(0)
        _aten("dA rows sum", pc, _nbytes(mb.DA_ROWS))
    return ReverseSweepResult(DG, mb.DKPRE0)


@dataclass
class _SweepMemory:
    """GPN+M's buffers of one chunk's reverse sweep (None for GPN): M0; the running suffix
    sum of dG, the per-row dA and k_0's pre-activation gradient (each (B, H) or (B, H*dk));
    per layer the block's kept do / dpred (`memory_backward_kernel`) and the Gram matrices
    (`chunk_gram`)."""

    M0: Tensor | None
    DGS: Tensor | None
    DA_ROWS: Tensor | None
    DKPRE0: Tensor | None
    kept: list[tuple[Tensor | None, Tensor | None]]
    grams: list[tuple[Tensor | None, Tensor | None]]
    # The memory backward's item queue and its launch settings, where its programs leave SMs
    # to the side stream (`_side_work_queue`); else None and {}.
    queue: Tensor | None = None
    reserve: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def none(n_layers: int) -> _SweepMemory:
        return _SweepMemory(
            None, None, None, None, [(None, None)] * n_layers, [(None, None)] * n_layers
        )


def _sweep_memory(plan: StepPlan, sweep: ReverseSweep, phase: str) -> _SweepMemory:
    assert sweep.M0 is not None  # GPN+M
    B, H, dk, dv = sweep.dP.shape[0], plan.H, plan.dk, plan.dv
    new = sweep.dP.new_empty
    DGS, DA_ROWS = new(B, H), new(B, H)
    DGS.zero_()
    DA_ROWS.zero_()
    _aten("zero dG suffix, dA rows", phase, 2 * _nbytes(DGS))
    # Each layer's do (and layer 0's dpred) over the current block of steps: what the
    # block's flush pushes onto the rows before it (`memory_backward_kernel`).
    S = _sweep_block(sweep.dP)
    L = plan.n_layers
    kept: list[tuple[Tensor | None, Tensor | None]] = [
        (new(B, H, S, dv), new(B, H, S, dv) if i == 0 else None) for i in range(L)
    ]
    M0 = sweep.M0.contiguous()
    gram = chunk_gram(plan, sweep.acts, phase)
    mb = _SweepMemory(M0, DGS, DA_ROWS, new(B, H * dk), kept, gram)
    mb.queue, mb.reserve = _side_work_queue(plan, sweep.dP, sweep.acts.p.shape[0], phase)
    return mb


def _side_work_queue(
    plan: StepPlan, like: Tensor, C: int, phase: str
) -> tuple[Tensor | None, dict]:
    """Where the side stream runs the backward's chunk-wide work beside the sweep
    (engine.overlap_backward), the memory backward leaves it a share of the SMs
    (engine.side_work_sm_share): its programs there leave at once and the rest take the grid's
    items from a counter (`triton_kernels.memory_backward_kernel`). The chunk's counters, one
    per step and layer, zero; and the launch settings. None and {} where nothing is left."""
    share = plan.options.side_work_sm_share if plan.options.overlap_backward else 0.0
    return side_work_queue(plan, like, C, share, phase)


def chunk_gram(plan: StepPlan, acts, phase: str) -> list[tuple[Tensor | None, Tensor | None]]:
    """Per layer, the chunk's Gram matrices (B, H, C, C) whose row t the memory backward
    reads at step t: q_t . k_j of the layer's read, and at layer 0 k_t . k_j of the write.
    One batched float32 matmul each before the sweep, in place of each step's head programs
    reducing the (C, dk) key tile again (the registers its pipelined loop needs)."""
    k = acts.k
    B, H, C, dk = k.shape
    flops = 2 * B * H * C * C * dk
    kk = torch.matmul(k, k.mT)
    _aten("Gram k k^T", phase, _nbytes(k, k, kk), flops)
    grams: list[tuple[Tensor | None, Tensor | None]] = []
    for i in range(plan.n_layers):
        qk = torch.matmul(acts.q[i], k.mT)
        _aten(f"Gram q k^T {i}", phase, _nbytes(acts.q[i], k, qk), flops)
        grams.append((qk, kk if i == 0 else None))
    return grams


def _read_norm_sums(
    plan: StepPlan, i: int, tau: int, acts, DH: Tensor, SUMS: Tensor, blocks: dict[str, int]
) -> None:
    """The read norm backward's (B, 2) row sums over this rank's columns, one program per
    row; under tp summed over the group (4). `memory_backward_kernel` reads them: each of a
    row's H head programs would otherwise sum all H * dv columns again (four dependent
    round trips each at 130M)."""
    ph = "reverse step"
    o, ro, y = acts.o[i][tau], acts.ro[i][tau], acts.y[i][tau]
    B = o.shape[0]
    _launch(
        tk.read_norm_sums_kernel,
        (B,),
        f"read norm sums {i}",
        ph,
        _nbytes(o, ro, SUMS) + 2 * _nbytes(o),
        4 * o.numel(),
        o,
        ro,
        acts.o[i].stride(1),
        DH,
        DH.stride(0),
        y,
        y.stride(0),
        SUMS,
        COL_RGATE=layer_meta(plan, i)["COL_RGATE"],
        HV=plan.H * plan.dv,
        BLOCK_HV=blocks["BLOCK_HV"],
        num_warps=ROW_WARPS,
        **geometry.dependent_launch(o),
    )
    if splits_over_tp(plan):
        tp_sum(SUMS, plan, f"read norm backward sums {i}", ph)


def _input_grad(
    plan: StepPlan,
    i: int,
    dy: Tensor,
    w_in_t: Tensor,
    DNP: Tensor | None,
    DN: Tensor,
    ws: SplitWorkspace,
) -> Tensor | None:
    """dY @ W_in^T into DN, or its split-K partials for the row kernel to sum (returned).
    Under tp (3): over the sharded column blocks, summed over the group, then the
    replicated predict gate's share (the last d blocks) added once."""
    ph = "reverse step"
    if DNP is None:  # no tp split
        return linear(dy, w_in_t, DN, ph, f"input dy W^T {i}", workspace=ws, sum_in_consumer=True,
                      projection="input_dx")  # fmt: skip
    pg0 = plan.columns[i].predict_gate[0]
    linear(dy[:, :pg0], w_in_t[:pg0], DNP, ph, f"input dy W^T {i}", workspace=ws,
           projection="input_dx")  # fmt: skip
    tp_sum(DNP, plan, f"input gradient {i}", ph)
    linear(
        dy[:, pg0:],
        w_in_t[pg0:],
        DN,
        ph,
        f"predict-gate dy W^T {i}",
        epilogue=3,
        res=DNP,
        workspace=ws,
        projection="input_dx",
    )
    return None


def _rev_row(
    plan: StepPlan,
    next_layer: int,
    tau: int,
    DN: Tensor,
    n: Tensor,
    x: Tensor,
    base: Tensor,
    acts,
    a,
    DG: Tensor,
    DCIN: Tensor,
    extra: Tensor | None,
    BD: int,
    ground: bool,
    dn_parts: Tensor | None = None,
) -> None:
    """dc = base (+ gate dg) + rms_back(n, x, DN) (+ extra); then start layer `next_layer`
    (>= 0) or end the step (next_layer < 0). `dn_parts`: DN's split-K partials (splits, B,
    d), summed here instead of by a launch of their own (`gemm.linear`'s sum_in_consumer)."""
    B, d = DN.shape
    splits = dn_parts.shape[0] if dn_parts is not None else 1
    then_layer = next_layer >= 0
    has_prev = not then_layer and tau > 0
    j = max(next_layer, 0)
    pg0 = plan.columns[j].predict_gate[0]
    y_j, dy_j = acts.y[j][tau], a.dY[j][tau]
    prev = tau - 1 if has_prev else tau
    _launch(
        tk.rev_row_kernel,
        (B,),
        "row backward",
        "reverse step",
        # dn's partials read in both passes (a row within one block: summed once, kept)
        _nbytes(DN) * ((4 if then_layer else 5) + (1 if d <= BD else 2) * splits),
        12 * B * d + 2 * (splits - 1) * B * d,
        dn_parts if dn_parts is not None else DN,
        B * d,
        n,
        x,
        d,
        base,
        base.stride(0),
        acts.gate[tau],
        DG,
        extra if extra is not None else DN,
        a.dZ[j][tau],
        y_j[:, pg0:],
        y_j.stride(0),
        acts.c[j][tau],
        dy_j[:, pg0:],
        dy_j.stride(0),
        DCIN,
        a.d_fuse[:, prev],
        a.d_fuse.stride(0),
        acts.p[prev],
        acts.gate[prev],
        a.dYfg[prev],
        d,
        plan.eps,
        BASE_GROUND=ground,
        HAS_EXTRA=extra is not None,
        THEN_LAYER=then_layer,
        HAS_PREV=has_prev,
        BLOCK_D=BD,
        DN_SPLITS=splits,
        WHOLE_ROW=d <= BD,
        num_warps=ROW_WARPS,
        **geometry.dependent_launch(DN),
    )


def _memory_backward(
    plan: StepPlan,
    i: int,
    tau: int,
    C: int,
    acts,
    a,
    DH: Tensor,
    mb: _SweepMemory,
    A: Tensor | None,
    grid: tuple[int, int],
    blocks: dict[str, int],
    eps: float,
    sums: Tensor | None = None,
) -> None:
    M0, kept, gram = mb.M0, mb.kept[i], mb.grams[i]
    H, dk, dv = plan.H, plan.dk, plan.dv
    mem, write = plan.memory, plan.memory and i == 0
    dY = a.dY[i]
    y, dy = acts.y[i][tau], dY[tau]
    B, dv_width = y.shape[0], geometry.p2(max(dv, 1))
    dummy = dy
    if mem:
        rq, drq = acts.rq[i][:, :, tau], a.dRq[i][:, :, tau]
        ro, stride_o = acts.ro[i][tau], acts.ro[i].stride(1)
        reads = [acts.q[i], rq, drq, acts.k, acts.U, acts.G, a.dK, a.dU, a.dG, M0, gram[0]]
        nbytes = _nbytes(y, dy, DH, ro, M0, sums) + _sweep_history_bytes(
            B, H, dk, dv, tau, C, _sweep_block(dy), write, y.element_size()
        )
        flops = B * H * ((4 if write else 2) * dk * dv + 12 * (tau + 1) * (dk + dv))
    else:
        ro, stride_o = None, 0
        reads = [None] * 11
        nbytes, flops = _nbytes(y, dy, DH), 0
    # (B, H, n) per-step tensors pass 2 strides, (B, H, C, n) chunk tensors 3 (last stride 1).
    mem_args = (
        ro if ro is not None else dummy,
        stride_o,
        *pointers(reads, [3, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3], dummy),
    )
    if write:
        writes = [
            acts.k_pre[tau],
            acts.v[:, :, tau],
            acts.beta[:, :, tau],
            acts.pred[:, :, tau],
            acts.rk[:, :, tau],
            a.dRk[:, :, tau],
            mb.DGS,
            mb.DA_ROWS,
            mb.DKPRE0,
            gram[1],
        ]
    else:
        writes = [None] * 10
    write_args = pointers(writes, [1, 2, 2, 2, 2, 2, 0, 0, 0, 3], dummy)
    _launch(
        tk.memory_backward_kernel,
        grid,
        f"memory/FFN backward {i}",
        "reverse step",
        nbytes,
        flops,
        y,
        y.stride(0),
        dy,
        dy.stride(0),
        dY[tau - 1] if write and tau > 0 else dy,
        DH,
        DH.stride(0),
        *mem_args,
        *write_args,
        A if mem else dummy,
        sums if sums is not None else dummy,
        *(t if t is not None else dummy for t in kept),  # the block's do and dpred
        mb.queue[tau, i] if mb.queue is not None else dummy,
        tau,
        int(tau == C - 1),
        eps,
        **layer_meta(plan, i),
        BLOCK_DV=min(dv_width, 8 if geometry.interpreting(y) else MEMORY_BACKWARD_BLOCK_DV),
        BLOCK_DVW=dv_width,
        BLOCK_DK=blocks["BLOCK_DK"],
        BLOCK_C=blocks["BLOCK_C"],
        BLOCK_F=blocks["BLOCK_F"],
        NORM_WIDTH=H * dv * plan.tp_size,
        BLOCK_S=_sweep_block(y),
        STAGES=MEMORY_BACKWARD_STAGES,
        num_warps=MEMORY_BACKWARD_WARPS,
        # the cap that lets four programs share an SM (ptxas alone takes ~150: three)
        maxnreg=MEMORY_BACKWARD_MAXNREG,
        **mb.reserve,
        **geometry.dependent_launch(y),
    )
    S = _sweep_block(y)
    if mem and tau % S == 0 and tau > 0:
        _flush_block(plan, i, tau, C, acts, a, kept, gram, S, write, B)


def _flush_block(
    plan: StepPlan,
    i: int,
    b0: int,
    C: int,
    acts,
    a,
    kept: tuple[Tensor | None, Tensor | None],
    gram: tuple[Tensor | None, Tensor | None],
    S: int,
    write: bool,
    B: int,
) -> None:
    """The block [b0, b0 + S)'s deferred pushes onto the rows before b0 (grid (B, H))."""
    H, dk, dv = plan.H, plan.dk, plan.dv
    dob, dpb = kept
    assert dob is not None
    size = dob.element_size()
    row = dk + dv + 1
    grams = 2 if write else 1
    # the rows' u and G and their Gram entries read, their adjoints read and written; the
    # block's queries, keys, decays and kept do / dpred
    history = b0 * (dv + 1 + grams * S) + 2 * b0 * row
    nbytes = B * H * (history + S * (2 * dk + 2 + dv * grams)) * size
    flops = B * H * b0 * S * (2 if write else 1) * (4 * dk + 6 * dv)
    warps, block_dv, stages = FLUSH_SETTINGS[write, geometry.arch(dob) >= 90]
    _launch(
        tk.memory_backward_flush_kernel,
        (B, H),
        f"memory backward block flush {i}",
        "reverse step",
        nbytes,
        flops,
        *pointers(
            [acts.q[i], acts.k, acts.U, acts.G, a.dK, a.dU, a.dG, gram[0], gram[1]],
            [3] * 9,
            dob,
        ),
        dob,
        dpb if dpb is not None else dob,
        b0,
        C,
        H=H,
        DK=dk,
        DV=dv,
        WRITE=write,
        BLOCK_DK=max(1 if geometry.interpreting(dob) else 16, geometry.p2(dk)),
        BLOCK_DV=min(geometry.p2(dv), 8 if geometry.interpreting(dob) else block_dv),
        BLOCK_J=S,
        BLOCK_S=S,
        num_warps=warps,
        maxnreg=FLUSH_MAXNREG,
        num_stages=stages,
        **geometry.dependent_launch(dob),
    )


def _sweep_block(t: Tensor) -> int:
    """Steps per block of the reverse sweep's deferred pushes (`memory_backward_kernel`):
    16 on a GPU (tl.dot's smallest tile), 4 in the interpreter (the tests' chunks of 4-20
    steps then hold several blocks, partial ones included)."""
    return 4 if geometry.interpreting(t) else SWEEP_BLOCK


def _sweep_history_bytes(
    B: int, H: int, dk: int, dv: int, tau: int, C: int, S: int, write: bool, size: int
) -> int:
    """HBM bytes of the chunk's history one reverse step moves: the keys, errors and
    decays up to t read (the read and the write need them all) with row t of the chunk's
    Gram matrices (q.k, and k.k for the write: `chunk_gram`), their adjoints read and
    written over the block's rows [b0, t], the step's do / dpred kept (the flush after a
    block's first step counts its own: `_flush_block`)."""
    row = dk + dv + 1
    b0 = tau - tau % S
    grams = 2 if write else 1
    moved = (tau + 1) * (row + grams) + 2 * (tau - b0 + 1) * row + dv * grams
    return B * H * moved * size
