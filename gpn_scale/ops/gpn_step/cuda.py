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

Here: the backend (eager or graphed per chunk). Beside it: cuda_forward.py (a chunk's
forward launches), cuda_reverse.py (its reverse sweep's) and cuda_shared.py (the kernels'
tiling and what both share).

Every launch goes through `_launch`, which can record it (name, phase, grid, bytes, FLOPs)
instead of or besides running it: `gpn_scale.accounting.gpu_model` runs this very code on meta
tensors at the real sizes to count launches, bytes and FLOPs per step.
"""

from __future__ import annotations

from gpn_scale.ops.execution import execution
from gpn_scale.ops.gpn_step.cuda_forward import forward_chunk_eager
from gpn_scale.ops.gpn_step.cuda_reverse import reverse_sweep_eager
from gpn_scale.ops.gpn_step.graphs import ChunkGraphs, replay_copy_bytes, unbound
from gpn_scale.ops.gpn_step.interface import (
    ChunkForward,
    ChunkForwardResult,
    LoopWeights,
    ReverseSweep,
    ReverseSweepResult,
    StepPlan,
)
from gpn_scale.ops.launch import is_dry
from gpn_scale.ops.launch import record_aten as _aten

# --------------------------------------------------------------------------- backend
GRAPH_COPIES = "graph copies in/out"  # recorded (dry runs) where a replay copies its buffers


class CudaBackend:
    """Triton kernels for the steps; chunks captured as CUDA graphs when the plan asks."""

    name = "cuda"
    # 16 elements: Triton's JIT then knows every weight row starts 16-byte aligned (it
    # specialises ints divisible by 16), and streams the weights in 16-byte loads.
    row_alignment = 16
    # dZ feeds only its step's down dy W^T GEMM and the down weight's gradient, both in the
    # matmul dtype: the row kernel writes it in bf16 (the same rounding each GEMM did), so
    # the GEMM's column tiles read half the A bytes and the weight gradient casts nothing.
    matmul_only_adjoints: tuple[str, ...] = ("dZ",)

    def __init__(self) -> None:
        self.graphs = ChunkGraphs()

    # -------------------------------------------------------------------- forward
    def forward_chunk(
        self, plan: StepPlan, W: LoopWeights, chunk: ChunkForward
    ) -> ChunkForwardResult:
        with execution(dependent_launch=plan.options.dependent_launch):
            return self._forward_chunk(plan, W, chunk)

    def reverse_sweep(
        self, plan: StepPlan, Wt: LoopWeights, sweep: ReverseSweep
    ) -> ReverseSweepResult:
        with execution(dependent_launch=plan.options.dependent_launch):
            return self._reverse_sweep(plan, Wt, sweep)

    def _forward_chunk(
        self, plan: StepPlan, W: LoopWeights, chunk: ChunkForward
    ) -> ChunkForwardResult:
        if is_dry() and plan.options.cuda_graphs:  # what a replay costs besides its kernels
            result = forward_chunk_eager(plan, W, chunk)
            moved = replay_copy_bytes(chunk, (chunk.P, chunk.S), result)
            _aten(GRAPH_COPIES, "forward chunk", moved)
            return result
        if self.graphs.wanted(plan, chunk.fuse):
            return self.graphs.forward(plan, W, chunk, forward_chunk_eager)
        return forward_chunk_eager(plan, W, chunk)

    def _reverse_sweep(
        self, plan: StepPlan, Wt: LoopWeights, sweep: ReverseSweep
    ) -> ReverseSweepResult:
        if is_dry() and plan.options.cuda_graphs:
            result = reverse_sweep_eager(plan, Wt, sweep)
            moved = replay_copy_bytes(sweep, unbound(sweep.adjoints), result)
            _aten(GRAPH_COPIES, "reverse chunk", moved)
            return result
        if self.graphs.wanted(plan, sweep.dP):
            return self.graphs.reverse(plan, Wt, sweep, reverse_sweep_eager)
        return reverse_sweep_eager(plan, Wt, sweep)
