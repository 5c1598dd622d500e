"""The CUDA step backend's forward chunk: each time step's launches (the input GEMM, the
memory/FFN kernel, the down-projection with its gated residual, the fuse gate), and under tp
the down-projection split at the group's fixed point. `cuda.py` says what each launch does
and how many a step takes; a CUDA graph captures this function (`graphs.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from gpn_scale.ops.gpn_step import geometry
from gpn_scale.ops.gpn_step import triton_kernels as tk
from gpn_scale.ops.gpn_step.cuda_shared import (
    MEMORY_FORWARD_HISTORY_BLOCK,
    MEMORY_FORWARD_MAXNREG,
    MEMORY_FORWARD_QUEUE_MAXNREG_SM80,
    MEMORY_FORWARD_QUEUE_ROW_BLOCK_BEFORE_3_8,
    MEMORY_FORWARD_QUEUE_STAGES_BEFORE_3_8,
    MEMORY_FORWARD_ROW_BLOCK,
    MEMORY_FORWARD_STAGES,
    MEMORY_FORWARD_STAGES_BF16_READS,
    MEMORY_FORWARD_WARPS,
    ffn_programs,
    layer_meta,
    mem_blocks,
    pointers,
    side_work_queue,
    splits_over_tp,
    tp_sum,
)
from gpn_scale.ops.gpn_step.gemm import SplitWorkspace, linear, low_sums_width
from gpn_scale.ops.gpn_step.interface import (
    ChunkForward,
    ChunkForwardResult,
    LoopWeights,
    StepPlan,
)
from gpn_scale.ops.launch import launch as _launch
from gpn_scale.ops.launch import nbytes as _nbytes
from gpn_scale.ops.launch import record_aten as _aten


def forward_chunk_eager(plan: StepPlan, W: LoopWeights, chunk: ChunkForward) -> ChunkForwardResult:
    """The chunk's steps as launches (what a graph captures)."""
    fuse, P, S = chunk.fuse, chunk.P, chunk.S
    B, C, d = fuse.shape
    H, dv, L, eps = plan.H, plan.dv, plan.n_layers, plan.eps
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
    hidden = _down_input(plan, W, fuse, B)
    scratch = [new(B, d), new(B, d)]
    ws = SplitWorkspace(fuse, plan.options.cublas_projections())
    split = splits_over_tp(plan)
    state_lows, layer_lows = _low_buffers(plan, W, states[0], hidden, bool(split))
    low_weights = bool(state_lows)
    # Under tp the row-parallel output before its sum; GPN+M: one buffer [ss | read part |
    # FFN part] summed by one all-reduce (collectives.reduce_down_with_norm).
    tp_flat = new(B * H + 2 * B * d) if split and mem else None
    partial = (
        tp_flat[B * H :].view(B, 2 * d) if tp_flat is not None else new(B, d) if split else None
    )
    BD = min(geometry.p2(d), 16 if geometry.interpreting(fuse) else 1024)
    blocks = mem_blocks(plan, fuse, C)
    grid_mem = (B, (H if mem else 0) + ffn_programs(plan, blocks["BLOCK_F"]))
    fm = _chunk_memory(plan, W, chunk, tp_flat, ws) if mem else _ChunkMemory()
    ss = fm.ss
    s = states[0]
    for tau in range(C):
        c = s
        c_low = state_lows[tau % 2] if low_weights and tau > 0 else None
        for i in range(L):
            y = ys[i]
            _input_gemm(W, i, tau, c, c_low, y, eps, ws)
            _memory_forward(plan, i, tau, y, hidden, fm, W.A, grid_mem, blocks)
            out = P[:, tau] if i == L - 1 else scratch[i % 2]
            pg0 = plan.columns[i].predict_gate[0]
            if split:
                _down_split(plan, i, hidden, W.w_out[i], ss, tp_flat, partial,
                            y[:, pg0 : pg0 + d], c, out, BD, ws)  # fmt: skip
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
                    low=layer_lows[i % 2] if low_weights and i < L - 1 else None,
                    workspace=ws,
                    projection="down",
                )
            c = out
            c_low = layer_lows[i % 2] if low_weights and i < L - 1 else None
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
            low=state_lows[(tau + 1) % 2] if low_weights else None,
            workspace=ws,
            projection="fuse_gate",
        )
        s = s_next
    s_prev = states[(C - 1) % 2]  # the state entering the chunk's last step
    return ChunkForwardResult(s, s_prev, fm.K, fm.U, fm.G)


Low = tuple[Tensor, Tensor]  # a GEMM's A rows in bf16 and their sums of squares per block


def _low_buffers(
    plan: StepPlan, W: LoopWeights, state: Tensor, hidden: Tensor, split: bool
) -> tuple[list[Low], list[Low | None]]:
    """bf16 weights: what feeds an input GEMM (the fuse gate's next state, a layer's output)
    is also written in bf16 with its sums of squares per column block, and the GEMM reads
    those (`gemm.linear`'s `low`): two buffers each (by step parity, by layer parity). The
    chunk's first state is the carry: its GEMM reads it in float32, as under tp a deeper
    layer's does its input (the gated residual kernel writes that)."""
    if W.w_in[0].dtype == state.dtype:
        return [], [None, None]
    B = state.shape[0]

    cublas = plan.options.cublas_projections()

    def low(a: Tensor, w: Tensor, writer: str, k1: int = 0) -> Low:  # the writer's linear's
        return (
            state.new_empty((B, w.shape[1]), dtype=W.w_in[0].dtype),
            state.new_empty((B, low_sums_width(a, w, k1, cublas=writer in cublas))),
        )

    deeper = plan.n_layers > 1 and not split
    k1 = plan.H * plan.dv if plan.memory else 0
    return (
        [low(state, W.w_fg, "fuse_gate") for _ in range(2)],
        [low(hidden, W.w_out[0], "down", k1) if deeper else None for _ in range(2)],
    )


def _input_gemm(
    W: LoopWeights,
    i: int,
    tau: int,
    c: Tensor,
    c_low: Low | None,
    y: Tensor,
    eps: float,
    ws: SplitWorkspace,
) -> None:
    """Layer i's input GEMM at step tau: from the rows' bf16 copy and sums where its
    producer left them, else from the float32 rows (the chunk's first state: its own name)."""
    if c_low is not None:
        linear(c_low[0], W.w_in[i], y, "forward step", f"input GEMM {i}", bias=W.b_in[i],
               split=(c_low[1], c.shape[1]), eps=eps, workspace=ws, projection="input")  # fmt: skip
        return
    name = "first-step input GEMM 0" if i == 0 and tau == 0 else f"input GEMM {i}"
    linear(c, W.w_in[i], y, "forward step", name, bias=W.b_in[i], row_rms=True, eps=eps,
           workspace=ws, projection="input")  # fmt: skip


def _down_input(plan: StepPlan, W: LoopWeights, like: Tensor, B: int) -> Tensor:
    """The down GEMM's input rows (the read output and the FFN's SwiGLU, written by the
    memory kernel) in the GEMM's weights' dtype, bf16 under autocast: the GEMM would cast
    every tile of a float32 row it loads, each column tile again. The kernel's store rounds
    as that cast does (to nearest even), so the product is bit-identical and its A operand
    half the bytes; the read norm's sums of squares are of the float32 output."""
    return like.new_empty((B, plan.H * plan.dv + plan.f), dtype=W.w_out[0].dtype)


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
        linear(hidden[:, :hv], w_out[:hv], partial[:, :d], ph, f"down GEMM read {i}", workspace=ws,
               projection="down")  # fmt: skip
        linear(hidden[:, hv:], w_out[hv:], partial[:, d:], ph, f"down GEMM FFN {i}", workspace=ws,
               projection="down")  # fmt: skip
        tp_sum(tp_flat, plan, f"down output + read norm sums {i}", ph)
    else:
        linear(hidden, w_out, partial, ph, f"down GEMM {i}", workspace=ws, projection="down")
        tp_sum(partial, plan, f"down output {i}", ph)
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
        **geometry.dependent_launch(out),
    )


@dataclass
class _ChunkMemory:
    """GPN+M's buffers of one chunk's forward steps (None for GPN): M0; the chunk's keys,
    errors and cumulative log-decays (K, U, G); the current key and G_{t-1}; the read's
    per-head sums of squares; and the memory forward's item counters and their launch
    settings where its programs leave SMs to the decode (`cuda_shared.side_work_queue`)."""

    M0: Tensor | None = None
    K: Tensor | None = None
    U: Tensor | None = None
    G: Tensor | None = None
    kcur: Tensor | None = None
    gprev: Tensor | None = None
    ss: Tensor | None = None
    queue: Tensor | None = None
    reserve: dict[str, int] = field(default_factory=dict)


def _chunk_memory(
    plan: StepPlan, W: LoopWeights, chunk: ChunkForward, tp_flat: Tensor | None, ws
) -> _ChunkMemory:
    """The chunk's memory buffers, and its first key (from the carried state before it)."""
    assert chunk.M0 is not None  # GPN+M
    fuse = chunk.fuse
    B, C, _ = fuse.shape
    H, dk, dv, eps = plan.H, plan.dk, plan.dv, plan.eps
    new = lambda *shape: fuse.new_empty(shape)  # noqa: E731
    pc = "forward chunk"
    fm = _ChunkMemory(M0=chunk.M0.contiguous())
    fm.K, fm.U, fm.G = new(B, H, C, dk), new(B, H, C, dv), new(B, H, C)
    fm.kcur, fm.gprev = new(B, H, dk), new(B, H)
    fm.ss = tp_flat[: B * H].view(B, H) if tp_flat is not None else new(B, H)
    fm.gprev.zero_()
    _aten("zero G", pc, _nbytes(fm.gprev))
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
        projection="input",
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
        fm.kcur,
        fm.kcur.stride(0),
        fm.kcur.stride(1),
        DK=dk,
        BLOCK_DK=geometry.p2(dk),
        **geometry.dependent_launch(key),
    )
    share = plan.options.side_work_sm_share if plan.options.overlap_decode else 0.0
    fm.queue, fm.reserve = side_work_queue(plan, fuse, C, share, pc)
    return fm


def _memory_forward(
    plan: StepPlan,
    i: int,
    tau: int,
    y: Tensor,
    hidden: Tensor,
    fm: _ChunkMemory,
    A: Tensor | None,
    grid: tuple[int, int],
    blocks: dict[str, int],
) -> None:
    ss, kcur, gprev, M0, K, U, G = fm.ss, fm.kcur, fm.gprev, fm.M0, fm.K, fm.U, fm.G
    H, dk, dv = plan.H, plan.dk, plan.dv
    mem = plan.memory
    B = y.shape[0]
    if mem:
        hist = (tau + 1) * B * H * (dk + dv + 1) * y.element_size()
        nbytes = _nbytes(y, hidden, M0) + hist
        flops = B * H * (4 * dk * dv + 4 * (tau + 1) * (dk + dv))
    else:
        nbytes, flops = _nbytes(y, hidden), 0
    at_256 = row_block(bool(fm.reserve))
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
        *pointers(
            [ss, kcur, gprev, M0, K, U, G, A] if mem else [None] * 8, [0, 0, 0, 3, 3, 3, 2, 0], y
        ),
        fm.queue[tau, i] if fm.queue is not None else y,
        tau,
        **layer_meta(plan, i),
        BLOCK_DV=geometry.p2(max(dv, 1)),
        BLOCK_DK=blocks["BLOCK_DK"],
        BLOCK_R=4 if geometry.interpreting(y) else rows_a_block(at_256, dv),
        BLOCK_J=2 if geometry.interpreting(y) else rows_a_block(MEMORY_FORWARD_HISTORY_BLOCK, dv),
        BLOCK_F=blocks["BLOCK_F"],
        STAGES=stages(at_256, M0 is not None and M0.dtype == torch.bfloat16),
        num_warps=MEMORY_FORWARD_WARPS,
        maxnreg=MEMORY_FORWARD_QUEUE_MAXNREG_SM80
        if fm.reserve and geometry.arch(y) < 90
        else MEMORY_FORWARD_MAXNREG,
        **fm.reserve,
        **geometry.dependent_launch(y),
    )


def row_block(queued: bool) -> int:
    """The M0 rows a memory forward program walks a block (at d_value 256): the item queue's
    under a Triton before 3.8 take fewer (cuda_shared says why)."""
    if queued and tk.triton_version() < (3, 8):
        return MEMORY_FORWARD_QUEUE_ROW_BLOCK_BEFORE_3_8
    return MEMORY_FORWARD_ROW_BLOCK


def stages(at_256: int, bf16_reads: bool) -> int:
    """The memory forward's pipeline stages for `row_block`'s rows of M0 (given for d_value
    256): 3 reading M0 in bf16, a fifth for the item queue's smaller blocks before Triton
    3.8, else 4 (cuda_shared says why)."""
    if bf16_reads:
        return MEMORY_FORWARD_STAGES_BF16_READS
    if at_256 == MEMORY_FORWARD_QUEUE_ROW_BLOCK_BEFORE_3_8:
        return MEMORY_FORWARD_QUEUE_STAGES_BEFORE_3_8
    return MEMORY_FORWARD_STAGES


def rows_a_block(at_256: int, dv: int) -> int:
    """The memory forward's rows a block (given for d_value 256): fewer for wider values, so
    that its (rows, d_value) accumulators keep their registers (d_value 512 with 16 rows
    spilled ~300 B a thread)."""
    return max(1, at_256 * 256 // max(geometry.p2(max(dv, 1)), 256))
