"""The CUDA step backend: each time step in a handful of Triton launches
(`triton_kernels.py`), each chunk's steps and reverse sweep replayable as a CUDA graph
(`graphs.py`).

Per step and layer, forward: the input GEMM (its RMSNorm a row scale in its epilogue), ONE
kernel for everything between the GEMMs (gates, l2-norms, the write's error term, the read
over M0 and the chunk's history, the FFN's SwiGLU), the down-projection with the read's
RMSNorm and the gated residual in its epilogue; then the fuse gate (a GEMM whose epilogue
grounds the next state). 1 layer: 4 launches a step; L layers: 3 L + 1.

Reverse sweep per step: the fuse gate's dy @ W^T and a row kernel (its RMSNorm backward and
the last layer's start), then per layer dc @ W_out^T, (GPN+M) a row kernel for the read
norm's backward sums, ONE memory/FFN kernel (the read and the write reversed, one pass over M0
for both), dY @ W_in^T and a row kernel. GPN+M 1 layer: 7, L layers: 5 L + 2; GPN: 4 L + 2.

Under tensor parallelism (plan.tp_size > 1) the step splits at the group's fixed points
(`collectives.py`, called through `tp_sum_`): forward, two down GEMMs write the row-parallel
partials of the read columns (unnormalised) and of the FFN columns beside the memory
kernel's per-head sums of squares of the read output, all summed in ONE all-reduce ((1) and
(2) together), and a small kernel applies the read norm's scale and adds the gated residual
(GPN without memory: one down GEMM, its partial summed (1), the residual kernel); reverse,
the read-norm row sums are summed (4) before the memory kernel reads them, and
dY @ W_in^T over the sharded column blocks is summed (3) before a second GEMM adds the
replicated predict gate's share in its epilogue. Per step: forward 5 L + 1 launches and L
all-reduces (GPN: 4 L + 1 and L), reverse 6 L + 2 and 2 L (GPN: 5 L + 2 and L). At tp = 1
none of the collectives runs: the launches are those above.

Every launch goes through `_launch`, which can record it (name, phase, grid, bytes, FLOPs)
instead of or besides running it: `gpn_scale.accounting.gpu_model` runs this very code on meta
tensors at the real sizes to count launches, bytes and FLOPs per step.
"""

from __future__ import annotations

from torch import Tensor

from gpn_scale.ops.gpn_step import geometry
from gpn_scale.ops.gpn_step import triton_kernels as tk
from gpn_scale.ops.gpn_step.collectives import tp_sum_
from gpn_scale.ops.gpn_step.gemm import SplitWorkspace, linear
from gpn_scale.ops.gpn_step.graphs import ChunkGraphs, _leaves
from gpn_scale.ops.gpn_step.interface import (
    ChunkForward,
    ChunkForwardResult,
    LoopWeights,
    ReverseSweep,
    ReverseSweepResult,
    StepPlan,
)
from gpn_scale.ops.launch import Launch, is_dry, recording  # noqa: F401  (re-exported)
from gpn_scale.ops.launch import launch as _launch
from gpn_scale.ops.launch import nbytes as _nbytes
from gpn_scale.ops.launch import record_aten as _aten
from gpn_scale.ops.launch import record_collective as _record_collective


def _layer_meta(plan: StepPlan, i: int) -> dict[str, int | bool]:
    """The compile-time shape of layer i's memory/FFN kernels (forward and reverse alike):
    sizes, the column offsets of its fused input matmul, and which parts it has."""
    c = plan.columns[i]
    at = lambda span: span[0] if span is not None else 0  # noqa: E731
    return dict(
        H=plan.H,
        DK=max(plan.dk, 1),
        DV=max(plan.dv, 1),
        F=plan.f,
        HV=plan.H * plan.dv,
        COL_KEY=at(c.key),
        COL_VALUE=at(c.value),
        COL_BETA=at(c.beta),
        COL_DECAY=at(c.decay),
        COL_QUERY=at(c.query),
        COL_RGATE=at(c.read_gate),
        COL_FFN=c.ffn[0],
        WRITE=plan.memory and i == 0,
        MEMORY=plan.memory,
    )


def _mem_blocks(plan: StepPlan, t: Tensor, C: int) -> dict[str, int]:
    small = geometry.interpreting(t)
    # tl.dot (the backward's block flush) needs every dimension >= 16 on a GPU.
    at_least = 1 if small else 16
    return dict(
        BLOCK_DK=max(at_least, geometry.p2(max(plan.dk, 1))),
        BLOCK_C=max(at_least, geometry.p2(C)),
        BLOCK_F=min(geometry.p2(plan.f), 16 if small else 512),
        BLOCK_HV=min(geometry.p2(max(plan.H * plan.dv, 1)), 16 if small else ROW_BLOCK),
    )


def _ffn_programs(plan: StepPlan, block_f: int) -> int:
    return geometry.cdiv(plan.f, block_f)


def _split(plan: StepPlan) -> bool:
    """Whether the step splits at the tp group's fixed points (`collectives.py`)."""
    return plan.tp_size > 1


def _tp_sum(x: Tensor, plan: StepPlan, name: str, phase: str) -> None:
    """One fixed point: x (contiguous) summed over the tp group, in place, through
    `collectives.tp_sum_` (recorded as a collective; a dry run only records it)."""
    _record_collective(name, phase, _nbytes(x))
    if not is_dry():
        tp_sum_(x, plan)


# The memory kernels' d_value block, warps and register cap on the GPU: what
# accounting/gpu_compile.py compiles without spills at the shipped configs, with at least two
# programs resident per SM (one program cannot hide its own round trips and issue latency).
# The backward at 4 warps x 16 d_value columns holds what 8 warps x 32 did per thread
# (<= 255 registers: 2 programs per SM, not 1); the forward at 32 columns needs ~140
# registers (3 per SM, not 2). The flush keeps 8 warps: at 4, or capped at 128 registers,
# it spills 150-260 bytes a thread.
MEMORY_BACKWARD_BLOCK_DV = 16
MEMORY_BACKWARD_WARPS = 4
MEMORY_BACKWARD_MAXNREG = 255
MEMORY_FORWARD_BLOCK_DV = 32
MEMORY_FORWARD_WARPS = 4
FLUSH_BLOCK_DV = 64
FLUSH_WARPS = 8
FLUSH_MAXNREG = 255
SWEEP_BLOCK = 16
# The reverse sweep's row kernels (one program per batch row: B programs, one per SM at most)
# take a whole row of d (or of the read's H * dv columns) in one block of 16 warps: each
# block of a row was a dependent round trip of its own (130M: 3 of 1,024 for d = 2,496, 4
# for the 3,840 read columns), and a row program is alone on its SM.
ROW_BLOCK = 4096
ROW_WARPS = 16

# --------------------------------------------------------------------------- backend
GRAPH_COPIES = "graph copies in/out"  # recorded (dry runs) where a replay copies its buffers


class CudaBackend:
    """Triton kernels for the steps; chunks captured as CUDA graphs when the plan asks."""

    name = "cuda"
    # 16 elements: Triton's JIT then knows every weight row starts 16-byte aligned (it
    # specialises ints divisible by 16), and streams the weights in 16-byte loads.
    row_alignment = 16

    def __init__(self) -> None:
        self.graphs = ChunkGraphs()

    # -------------------------------------------------------------------- forward
    def forward_chunk(
        self, plan: StepPlan, W: LoopWeights, chunk: ChunkForward
    ) -> ChunkForwardResult:
        if is_dry() and plan.options.cuda_graphs:  # what a replay costs besides its kernels
            _aten(GRAPH_COPIES, "forward chunk", 2 * _nbytes(*_leaves(chunk)))
        if self.graphs.wanted(plan, chunk.fuse):
            return self.graphs.forward(plan, W, chunk, forward_chunk_eager)
        return forward_chunk_eager(plan, W, chunk)

    def reverse_sweep(
        self, plan: StepPlan, Wt: LoopWeights, sweep: ReverseSweep
    ) -> ReverseSweepResult:
        if is_dry() and plan.options.cuda_graphs:
            _aten(GRAPH_COPIES, "reverse chunk", 2 * _nbytes(*_leaves(sweep)))
        if self.graphs.wanted(plan, sweep.dP):
            return self.graphs.reverse(plan, Wt, sweep, reverse_sweep_eager)
        return reverse_sweep_eager(plan, Wt, sweep)


def forward_chunk_eager(plan: StepPlan, W: LoopWeights, chunk: ChunkForward) -> ChunkForwardResult:
    """The chunk's steps as launches (what a graph captures)."""
    fuse, P, S = chunk.fuse, chunk.P, chunk.S
    B, C, d = fuse.shape
    H, dk, dv, f, L, eps = plan.H, plan.dk, plan.dv, plan.f, plan.n_layers, plan.eps
    mem = plan.memory
    new = lambda *shape: fuse.new_empty(shape)  # noqa: E731
    ph, pc = "forward step", "forward chunk"
    states = [new(B, d), new(B, d)]
    states[0].copy_(chunk.s)
    _aten("copy s", pc, 2 * _nbytes(chunk.s))
    if S is not None:
        S[:, 0].copy_(chunk.s)
        _aten("copy S[0]", pc, 2 * _nbytes(chunk.s))
    ys = [new(B, plan.columns[i].width) for i in range(L)]
    hidden = new(B, H * dv + f)
    scratch = [new(B, d), new(B, d)]
    ws = SplitWorkspace(fuse)
    split = _split(plan)
    # Under tp the row-parallel output before its sum; GPN+M: one buffer [ss | read part |
    # FFN part] summed by one all-reduce (collectives.reduce_down_with_norm).
    tp_flat = new(B * H + 2 * B * d) if split and mem else None
    partial = (
        tp_flat[B * H :].view(B, 2 * d) if tp_flat is not None else new(B, d) if split else None
    )
    BD = min(geometry.p2(d), 16 if geometry.interpreting(fuse) else 1024)
    blocks = _mem_blocks(plan, fuse, C)
    grid_mem = (B, (H if mem else 0) + _ffn_programs(plan, blocks["BLOCK_F"]))
    # GPN+M's memory buffers (None for GPN).
    M0: Tensor | None
    K: Tensor | None
    U: Tensor | None
    G: Tensor | None
    kcur: Tensor | None
    gprev: Tensor | None
    ss: Tensor | None
    if mem:
        assert chunk.M0 is not None  # GPN+M
        M0 = chunk.M0.contiguous()
        K, U, G = new(B, H, C, dk), new(B, H, C, dv), new(B, H, C)
        kcur, gprev = new(B, H, dk), new(B, H)
        ss = tp_flat[: B * H].view(B, H) if tp_flat is not None else new(B, H)
        gprev.zero_()
        _aten("zero G", pc, _nbytes(gprev))
        key = new(B, H * dk)
        linear(
            chunk.s_prev,
            W.w_in[0][:, : H * dk],
            key,
            pc,
            "first key GEMM",
            bias=W.b_in[0][: H * dk],
            row_rms=True,
            eps=eps,
            workspace=ws,
        )
        _launch(
            tk.l2n_relu_kernel,
            (B, H),
            "first key l2n",
            pc,
            2 * _nbytes(key),
            4 * key.numel(),
            key,
            key.stride(0),
            kcur,
            kcur.stride(0),
            kcur.stride(1),
            DK=dk,
            BLOCK_DK=geometry.p2(dk),
        )
    else:
        M0 = K = U = G = kcur = gprev = ss = None
    s = states[0]
    for tau in range(C):
        c = s
        for i in range(L):
            y = ys[i]
            linear(
                c,
                W.w_in[i],
                y,
                ph,
                f"input GEMM {i}",
                bias=W.b_in[i],
                row_rms=True,
                eps=eps,
                workspace=ws,
            )
            _memory_forward(
                plan, i, tau, y, hidden, ss, kcur, gprev, M0, K, U, G, W.A, grid_mem, blocks
            )
            out = P[:, tau] if i == L - 1 else scratch[i % 2]
            pg0 = plan.columns[i].predict_gate[0]
            if split:
                _down_split(
                    plan,
                    i,
                    hidden,
                    W.w_out[i],
                    ss,
                    tp_flat,
                    partial,
                    y[:, pg0 : pg0 + d],
                    c,
                    out,
                    BD,
                    ws,
                )
            else:
                linear(
                    hidden,
                    W.w_out[i],
                    out,
                    ph,
                    f"down GEMM {i}",
                    split=(ss, H * dv) if ss is not None else None,  # ss: GPN+M
                    eps=eps,
                    epilogue=1,
                    pg=y[:, pg0 : pg0 + d],
                    res=c,
                    workspace=ws,
                )
            c = out
        s_next = states[(tau + 1) % 2]
        linear(
            c,
            W.w_fg,
            s_next,
            ph,
            "fuse-gate GEMM",
            bias=W.b_fg,
            row_rms=True,
            eps=eps,
            epilogue=2,
            res=c,
            fuse=fuse[:, tau],
            out2=S[:, tau + 1] if S is not None and tau + 1 < C else None,
            workspace=ws,
        )
        s = s_next
    s_prev = states[(C - 1) % 2]  # the state entering the chunk's last step
    return ChunkForwardResult(s, s_prev, K, U, G)


def _down_split(
    plan: StepPlan,
    i: int,
    hidden: Tensor,
    w_out: Tensor,
    ss: Tensor | None,
    tp_flat: Tensor | None,
    partial: Tensor | None,
    pg: Tensor,
    c: Tensor,
    out: Tensor,
    BD: int,
    ws: SplitWorkspace,
) -> None:
    """Under tp, one all-reduce per step and layer, then the gated residual. GPN+M: the
    down-projection's read columns (unnormalised) and its FFN columns as two row-parallel
    partials beside the read norm's sums of squares in one buffer, summed (fixed points (1)
    and (2) at once); the residual kernel applies the full-width norm's scale to the read
    part: out = sigmoid(pg) * c + r * read + ffn. GPN: the partial summed (1), then
    out = sigmoid(pg) * c + sum."""
    ph = "forward step"
    B, d = out.shape
    hv = plan.H * plan.dv
    assert partial is not None  # given under tp
    if plan.memory:
        assert tp_flat is not None and ss is not None
        linear(hidden[:, :hv], w_out[:hv], partial[:, :d], ph, f"down GEMM read {i}", workspace=ws)
        linear(hidden[:, hv:], w_out[hv:], partial[:, d:], ph, f"down GEMM FFN {i}", workspace=ws)
        _tp_sum(tp_flat, plan, f"down output + read norm sums {i}", ph)
    else:
        linear(hidden, w_out, partial, ph, f"down GEMM {i}", workspace=ws)
        _tp_sum(partial, plan, f"down output {i}", ph)
    _launch(
        tk.gated_residual_kernel,
        (B,),
        f"gated residual {i}",
        ph,
        _nbytes(partial, ss) + 3 * _nbytes(out),
        (5 if plan.memory else 3) * B * d,
        partial,
        partial.stride(0),
        pg,
        pg.stride(0),
        c,
        c.stride(0),
        out,
        out.stride(0),
        ss if ss is not None else partial,
        d,
        plan.eps,
        SS_WIDTH=hv * plan.tp_size if plan.memory else 1,
        N_SS=geometry.p2(ss.shape[1]) if ss is not None else 1,
        SS_COLS=ss.shape[1] if ss is not None else 1,
        NORM=plan.memory,
        BLOCK_D=BD,
    )


def _memory_forward(
    plan: StepPlan,
    i: int,
    tau: int,
    y: Tensor,
    hidden: Tensor,
    ss: Tensor | None,
    kcur: Tensor | None,
    gprev: Tensor | None,
    M0: Tensor | None,
    K: Tensor | None,
    U: Tensor | None,
    G: Tensor | None,
    A: Tensor | None,
    grid: tuple[int, int],
    blocks: dict[str, int],
) -> None:
    H, dk, dv = plan.H, plan.dk, plan.dv
    mem = plan.memory
    B = y.shape[0]
    if mem:
        hist = (tau + 1) * B * H * (dk + dv + 1) * y.element_size()
        nbytes = _nbytes(y, hidden, M0) + hist
        flops = B * H * (4 * dk * dv + 4 * (tau + 1) * (dk + dv))
    else:
        nbytes, flops = _nbytes(y, hidden), 0
    _launch(
        tk.memory_forward_kernel,
        grid,
        f"memory/FFN {i}",
        "forward step",
        nbytes,
        flops,
        y,
        y.stride(0),
        hidden,
        hidden.stride(0),
        *_pointers(
            [ss, kcur, gprev, M0, K, U, G, A] if mem else [None] * 8, [0, 0, 0, 3, 3, 3, 2, 0], y
        ),
        tau,
        **_layer_meta(plan, i),
        BLOCK_DV=min(
            geometry.p2(max(dv, 1)), 8 if geometry.interpreting(y) else MEMORY_FORWARD_BLOCK_DV
        ),
        BLOCK_DK=blocks["BLOCK_DK"],
        BLOCK_C=blocks["BLOCK_C"],
        BLOCK_F=blocks["BLOCK_F"],
        num_warps=MEMORY_FORWARD_WARPS,
    )


# -------------------------------------------------------------------------- reverse
def reverse_sweep_eager(plan: StepPlan, Wt: LoopWeights, sweep: ReverseSweep) -> ReverseSweepResult:
    """The chunk's reverse sweep as launches (what a graph captures)."""
    acts, a, dP = sweep.acts, sweep.adjoints, sweep.dP
    C, B, d = acts.p.shape
    H, dk, dv, f, L, eps = plan.H, plan.dk, plan.dv, plan.f, plan.n_layers, plan.eps
    mem = plan.memory
    new = lambda *shape: dP.new_empty(shape)  # noqa: E731
    ph, pc = "reverse step", "reverse chunk"
    DG, DN, DCIN = new(B, d), new(B, d), new(B, d)
    DH = new(B, H * dv + f)
    ws = SplitWorkspace(dP)
    blocks = _mem_blocks(plan, dP, C)
    grid_mem = (B, (H if mem else 0) + _ffn_programs(plan, blocks["BLOCK_F"]))
    BD = min(geometry.p2(d), 16 if geometry.interpreting(dP) else ROW_BLOCK)
    split = _split(plan)
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
    )
    # GPN+M's memory buffers (None for GPN).
    M0: Tensor | None
    DGS: Tensor | None
    DA_ROWS: Tensor | None
    DKPRE0: Tensor | None
    kept: list[tuple[Tensor | None, Tensor | None]]
    if mem:
        assert sweep.M0 is not None  # GPN+M
        M0 = sweep.M0.contiguous()
        DGS, DA_ROWS, DKPRE0 = new(B, H), new(B, H), new(B, H * dk)
        DGS.zero_()
        DA_ROWS.zero_()
        _aten("zero dG suffix, dA rows", pc, 2 * _nbytes(DGS))
        # Each layer's do (and layer 0's dpred) over the current block of steps: what the
        # block's flush pushes onto the rows before it (`memory_backward_kernel`).
        S_blk = _sweep_block(dP)
        kept = [(new(B, H, S_blk, dv), new(B, H, S_blk, dv) if i == 0 else None) for i in range(L)]
    else:
        M0 = DGS = DA_ROWS = DKPRE0 = None
        kept = [(None, None)] * L
    for tau in range(C - 1, -1, -1):
        linear(a.dYfg[tau], Wt.w_fg, DN, ph, "fuse-gate dy W^T", workspace=ws)
        _rev_row(
            plan,
            L - 1,
            tau,
            DN,
            acts.n_p[tau],
            acts.p[tau],
            dP[:, tau],
            acts,
            a,
            DG,
            DCIN,
            None,
            BD,
            ground=True,
        )
        for i in range(L - 1, -1, -1):
            linear(a.dZ[i][tau], Wt.w_out[i], DH, ph, f"down dy W^T {i}", workspace=ws)
            if SUMS is not None:
                _read_norm_sums(plan, i, tau, acts, DH, SUMS, blocks)
            _memory_backward(
                plan,
                i,
                tau,
                C,
                acts,
                a,
                DH,
                M0,
                DGS,
                DA_ROWS,
                DKPRE0,
                Wt.A,
                grid_mem,
                blocks,
                eps,
                SUMS,
                kept[i],
            )
            if split:
                _input_grad_split(plan, i, a.dY[i][tau], Wt.w_in[i], DNP, DN, ws)
            else:
                linear(a.dY[i][tau], Wt.w_in[i], DN, ph, f"input dy W^T {i}", workspace=ws)
            _rev_row(
                plan,
                i - 1,
                tau,
                DN,
                acts.n[i][tau],
                acts.c[i][tau],
                DCIN,
                acts,
                a,
                DG,
                DCIN,
                extra if tau == C - 1 and i == 0 else None,
                BD,
                ground=False,
            )
    if mem:
        assert a.dA is not None and DA_ROWS is not None  # GPN+M
        a.dA += DA_ROWS.sum(0)
        _aten("dA rows sum", pc, _nbytes(DA_ROWS))
    return ReverseSweepResult(DG, DKPRE0)


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
        COL_RGATE=_layer_meta(plan, i)["COL_RGATE"],
        HV=plan.H * plan.dv,
        BLOCK_HV=blocks["BLOCK_HV"],
        num_warps=ROW_WARPS,
    )
    if _split(plan):
        _tp_sum(SUMS, plan, f"read norm backward sums {i}", ph)


def _input_grad_split(
    plan: StepPlan,
    i: int,
    dy: Tensor,
    w_in_t: Tensor,
    DNP: Tensor | None,
    DN: Tensor,
    ws: SplitWorkspace,
) -> None:
    """Under tp (3): dY @ W_in^T over the sharded column blocks, summed over the group,
    then the replicated predict gate's share (the last d blocks) added once."""
    ph = "reverse step"
    assert DNP is not None  # given under tp
    pg0 = plan.columns[i].predict_gate[0]
    linear(dy[:, :pg0], w_in_t[:pg0], DNP, ph, f"input dy W^T {i}", workspace=ws)
    _tp_sum(DNP, plan, f"input gradient {i}", ph)
    linear(
        dy[:, pg0:],
        w_in_t[pg0:],
        DN,
        ph,
        f"predict-gate dy W^T {i}",
        epilogue=3,
        res=DNP,
        workspace=ws,
    )


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
) -> None:
    """dc = base (+ gate dg) + rms_back(n, x, DN) (+ extra); then start layer `next_layer`
    (>= 0) or end the step (next_layer < 0)."""
    B, d = DN.shape
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
        _nbytes(DN) * (6 if then_layer else 7),
        12 * B * d,
        DN,
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
        num_warps=ROW_WARPS,
    )


def _pointers(tensors: list[Tensor | None], strides: list[int], dummy: Tensor) -> tuple:
    """Kernel arguments: each tensor followed by its first n strides; for a variant of the
    kernel that never reads it (None), a dummy pointer of the same dtype and zero strides."""
    args: list = []
    for t, n in zip(tensors, strides):
        args += [dummy, *(0,) * n] if t is None else [t, *t.stride()[:n]]
    return tuple(args)


def _memory_backward(
    plan: StepPlan,
    i: int,
    tau: int,
    C: int,
    acts,
    a,
    DH: Tensor,
    M0: Tensor | None,
    DGS,
    DA_ROWS,
    DKPRE0,
    A: Tensor | None,
    grid: tuple[int, int],
    blocks: dict[str, int],
    eps: float,
    sums: Tensor | None = None,
    kept: tuple[Tensor | None, Tensor | None] = (None, None),
) -> None:
    H, dk, dv = plan.H, plan.dk, plan.dv
    mem, write = plan.memory, plan.memory and i == 0
    dY = a.dY[i]
    y, dy = acts.y[i][tau], dY[tau]
    B = y.shape[0]
    dummy = dy
    if mem:
        rq, drq = acts.rq[i][:, :, tau], a.dRq[i][:, :, tau]
        ro, stride_o = acts.ro[i][tau], acts.ro[i].stride(1)
        reads = [acts.q[i], rq, drq, acts.k, acts.U, acts.G, a.dK, a.dU, a.dG, M0]
        nbytes = _nbytes(y, dy, DH, ro, M0, sums) + _sweep_history_bytes(
            B, H, dk, dv, tau, C, _sweep_block(dy), write, y.element_size()
        )
        flops = B * H * ((4 if write else 2) * dk * dv + 12 * (tau + 1) * (dk + dv))
    else:
        ro = None
        stride_o = 0
        reads = [None] * 10
        nbytes, flops = _nbytes(y, dy, DH), 0
    # (B, H, n) per-step tensors pass 2 strides, (B, H, C, n) chunk tensors 3 (last stride 1).
    mem_args = (
        ro if ro is not None else dummy,
        stride_o,
        *_pointers(reads, [3, 2, 2, 3, 3, 3, 3, 3, 3, 3], dummy),
    )
    if write:
        writes = [
            acts.k_pre[tau],
            acts.v[:, :, tau],
            acts.beta[:, :, tau],
            acts.pred[:, :, tau],
            acts.rk[:, :, tau],
            a.dRk[:, :, tau],
            DGS,
            DA_ROWS,
            DKPRE0,
        ]
    else:
        writes = [None] * 9
    write_args = _pointers(writes, [1, 2, 2, 2, 2, 2, 0, 0, 0], dummy)
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
        kept[0] if kept[0] is not None else dummy,
        kept[1] if kept[1] is not None else dummy,
        tau,
        int(tau == C - 1),
        eps,
        **_layer_meta(plan, i),
        BLOCK_DV=min(
            geometry.p2(max(dv, 1)), 8 if geometry.interpreting(y) else MEMORY_BACKWARD_BLOCK_DV
        ),
        BLOCK_DK=blocks["BLOCK_DK"],
        BLOCK_C=blocks["BLOCK_C"],
        BLOCK_F=blocks["BLOCK_F"],
        NORM_WIDTH=H * dv * plan.tp_size,
        BLOCK_S=_sweep_block(y),
        num_warps=MEMORY_BACKWARD_WARPS,
        # ptxas otherwise caps the layers above 0 (no write) at 128 registers and spills
        maxnreg=MEMORY_BACKWARD_MAXNREG,
    )
    S = _sweep_block(y)
    if mem and tau % S == 0 and tau > 0:
        _flush_block(plan, i, tau, C, acts, a, kept, S, write, B)


def _flush_block(
    plan: StepPlan,
    i: int,
    b0: int,
    C: int,
    acts,
    a,
    kept: tuple[Tensor | None, Tensor | None],
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
    nbytes = B * H * (3 * b0 * row + S * (2 * dk + 2 + dv * (2 if write else 1))) * size
    flops = B * H * b0 * S * (2 if write else 1) * (4 * dk + 6 * dv)
    _launch(
        tk.memory_backward_flush_kernel,
        (B, H),
        f"memory backward block flush {i}",
        "reverse step",
        nbytes,
        flops,
        *_pointers(
            [acts.q[i], acts.k, acts.U, acts.G, a.dK, a.dU, a.dG], [3, 3, 3, 3, 3, 3, 3], dob
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
        BLOCK_DV=min(geometry.p2(dv), 8 if geometry.interpreting(dob) else FLUSH_BLOCK_DV),
        BLOCK_J=S,
        BLOCK_S=S,
        num_warps=FLUSH_WARPS,
        maxnreg=FLUSH_MAXNREG,
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
    decays up to t read (the read and the write need them all; the keys twice), their
    adjoints read and written over the block's rows [b0, t], the step's do / dpred kept
    (the flush after a block's first step counts its own: `_flush_block`)."""
    row = dk + dv + 1
    b0 = tau - tau % S
    # the keys are read twice (before and after the d_value loop: registers)
    moved = (tau + 1) * (row + dk) + 2 * (tau - b0 + 1) * row + dv * (2 if write else 1)
    return B * H * moved * size
