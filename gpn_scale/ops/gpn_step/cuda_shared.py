"""What the CUDA step backend's forward (`cuda_forward.py`) and reverse (`cuda_reverse.py`)
launches share: how the memory and row kernels are tiled on the GPU (d_value blocks, warps,
register caps), each layer's compile-time shape, the packing of optional tensors into kernel
arguments, and the tp group's fixed points as recorded collectives."""

from __future__ import annotations

import torch
from torch import Tensor

from gpn_scale.ops.gpn_step import geometry
from gpn_scale.ops.gpn_step import triton_kernels as tk
from gpn_scale.ops.gpn_step.collectives import tp_sum_
from gpn_scale.ops.gpn_step.interface import StepPlan
from gpn_scale.ops.launch import is_dry
from gpn_scale.ops.launch import nbytes as _nbytes
from gpn_scale.ops.launch import record_aten as _aten
from gpn_scale.ops.launch import record_collective as _record_collective

# The memory kernels' blocks, warps, stages and register cap on the GPU: what
# accounting/gpu_compile.py compiles without spills at the shipped configs, with at least two
# programs resident per SM (one program cannot hide its own round trips and issue latency).
# Both kernels sum their products over d_value (backward) or over M0's and the history's rows
# (forward) elementwise in 2-D accumulators and reduce them once after their loops: a
# reduction in every iteration was shuffles (and, across warps, shared memory and barriers)
# that took most of each loop's instructions. The backward first forms the step's value
# adjoints (do, dpred and what they give) over all of d_value at once, a value or two per
# thread, and its d_value loop reads them back by blocks: inside the loop every thread of a
# row had computed them again. Its loop is software-pipelined (STAGES: cp.async copies of the
# next blocks' tiles while this one computes) and its epilogue issues every load before its
# first store: 3 round trips a program (the value adjoints' loads, the loop's first block,
# the epilogue's loads). It fits since the (C, dk) key tile's reductions moved to a
# chunk-wide matmul (cuda_reverse.chunk_gram) and the k adjoint's read-modify-write covers
# the block's BLOCK_S rows, not all C. 8 value columns a block: 16 leave the accumulators
# 28 B of spills at 128 registers; with 8 an iteration issues in less than a round trip over
# the stages ahead (accounting: pricing.pipeline_waits), so 6 stages (3 programs per SM on
# sm_80's shared memory, 4 on sm_90). The forward walks M0's rows 16 at a time and the
# history's 8 (a history row is 1.5 M0 rows), both loops pipelined at 4 stages, ~121
# registers, 4 programs per SM on sm_90. The alternatives the accounting priced slower are
# timed beside these by the device check (bench/gpu_ledger.WHAT_IFS). The block flush reads
# its products from the same Gram matrices (it formed them with tl.dot from the key tile,
# at 251 registers): 8 warps capped at 128 registers compile without spills, two programs
# per SM (was one).
MEMORY_BACKWARD_BLOCK_DV = 8
MEMORY_BACKWARD_WARPS = 4
MEMORY_BACKWARD_MAXNREG = 128
MEMORY_BACKWARD_STAGES = 6
MEMORY_FORWARD_ROW_BLOCK = 16
# ... in its item queue (side_work_sm_share) with a Triton before 3.8 (3.6: the GPU image's).
# Its M0 loop reads the q and k rows of a block again each iteration; 3.8 copies each row
# once (cp.async) and shares it, 3.6 copies every row a thread holds (8 of 16), and LLVM
# keeps those copies' shared-memory addresses in registers across the item loop: 164 B a
# thread of spills at 16 rows, none at 8. Accounting, 130M, B = 128, H200, under 3.6: 1.196
# -> 1.159 s a step; under 3.8 8 rows would cost 1.104 -> 1.128 s, so 3.8 keeps 16.
MEMORY_FORWARD_QUEUE_ROW_BLOCK_BEFORE_3_8 = 8
# ... and its stages there: a block of 8 rows is half the bytes of an iteration, so a fifth
# stage keeps more of M0 in flight (32 rows ahead, against 24 at 4) in 49 KB of shared
# memory, still 4 programs per SM on sm_90. Accounting under 3.6, as above: 1.152 -> 1.141 s
# a step (the memory forward 0.3154 -> 0.3046 s); 6 stages hold it to 3 programs (1.188 s).
MEMORY_FORWARD_QUEUE_STAGES_BEFORE_3_8 = 5
MEMORY_FORWARD_HISTORY_BLOCK = 8
MEMORY_FORWARD_WARPS = 4
MEMORY_FORWARD_STAGES = 4
# ... reading M0 in bf16 (engine.bf16_memory_reads): the widening of its tiles takes what a
# fourth stage left (4 spilled 8 B a thread on sm_90 at 130M); 3 stages of half the bytes.
MEMORY_FORWARD_STAGES_BF16_READS = 3
MEMORY_FORWARD_MAXNREG = 128
# ... for its item queue on sm_80 (side_work_sm_share): there its shared memory holds it to 3
# programs per SM whatever its registers, which leave 168 a thread; at 128 the queue's loop
# spilled 4 B at the 1B's tp = 8 rank.
MEMORY_FORWARD_QUEUE_MAXNREG_SM80 = 168
# The block flush's (warps, value columns a block, stages), by whether the layer writes the
# memory and whether the GPU is sm_90 (else sm_80). Its (J, DK) k adjoint rows are read with
# the block's other loads and held over the value loop (two round trips fewer a block of
# rows); at the 128-register cap the settings that hold them without a spill differ by
# variant, arch and Triton version (ptxas), so each entry is the fastest the accounting
# prices among those that compile spill-free with both triton 3.8 (the pin) and 3.6 (the
# GPU image's): e.g. a writing layer on sm_90 at 4 warps and 32 columns (four programs an
# SM) spilled 4 B under 3.6, a reading one at 4 warps and 2 stages too.
FLUSH_SETTINGS = {
    (True, True): (8, 64, 2),
    (True, False): (4, 32, 2),
    (False, True): (4, 64, 1),
    (False, False): (8, 64, 2),
}
FLUSH_MAXNREG = 128
SWEEP_BLOCK = 16
# The FFN columns a program of the memory/FFN kernels takes (after a row's head programs):
# each program pays a round trip and its launch slot whatever its width, and 512-wide ones
# were 13 short programs a row at 130M (1,664 of the 3,584 at B = 128), a wave's worth of
# slots; 2,048 (4 a row) compile without spills in both kernels (4,096 spill the
# backward's). Accounting, B = 128: 1.453 -> 1.417 s a step (1,024: 1.423).
FFN_BLOCK = 2048
# The reverse sweep's row kernels (one program per batch row: B programs, one per SM at most)
# take a whole row of d (or of the read's H * dv columns) in one block of 16 warps: each
# block of a row was a dependent round trip of its own (130M: 3 of 1,024 for d = 2,496, 4
# for the 3,840 read columns), and a row program is alone on its SM.
ROW_BLOCK = 4096
ROW_WARPS = 16


def layer_meta(plan: StepPlan, i: int) -> dict[str, int | bool]:
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


def mem_blocks(plan: StepPlan, t: Tensor, C: int) -> dict[str, int]:
    """The memory/FFN kernels' blocks over d_key, a chunk of C steps, the FFN and the read's
    H * dv columns (small ones in the interpreter, whose tests use tiny shapes)."""
    small = geometry.interpreting(t)
    # tl.dot (the backward's block flush) needs every dimension >= 16 on a GPU.
    at_least = 1 if small else 16
    return dict(
        BLOCK_DK=max(at_least, geometry.p2(max(plan.dk, 1))),
        BLOCK_C=max(at_least, geometry.p2(C)),
        BLOCK_F=min(geometry.p2(plan.f), 16 if small else FFN_BLOCK),
        BLOCK_HV=min(geometry.p2(max(plan.H * plan.dv, 1)), 16 if small else ROW_BLOCK),
    )


def ffn_programs(plan: StepPlan, block_f: int) -> int:
    """Programs per row that the memory/FFN kernel gives the FFN (after its H head programs)."""
    return geometry.cdiv(plan.f, block_f)


def splits_over_tp(plan: StepPlan) -> bool:
    """Whether the step splits at the tp group's fixed points (`collectives.py`)."""
    return plan.tp_size > 1


def tp_sum(x: Tensor, plan: StepPlan, name: str, phase: str) -> None:
    """One fixed point: x (contiguous) summed over the tp group, in place, through
    `collectives.tp_sum_` (recorded as a collective; a dry run only records it)."""
    _record_collective(name, phase, _nbytes(x))
    if not is_dry():
        tp_sum_(x, plan)


def pointers(tensors: list[Tensor | None], strides: list[int], dummy: Tensor) -> tuple:
    """Kernel arguments: each tensor followed by its first n strides; for a variant of the
    kernel that never reads it (None), a dummy pointer of the same dtype and zero strides."""
    args: list = []
    for t, n in zip(tensors, strides):
        args += [dummy, *(0,) * n] if t is None else [t, *t.stride()[:n]]
    return tuple(args)


def side_work_queue(
    plan: StepPlan, like: Tensor, C: int, share: float, phase: str
) -> tuple[Tensor | None, dict[str, int]]:
    """A memory kernel that leaves `share` of the SMs to a side stream's work (its programs
    there leave at once; the rest take the grid's items from a counter: `triton_kernels.
    _first_item`): the chunk's counters, one per step and layer, zero, and the launch
    settings; None and {} where nothing is left (share 0, or too few SMs for a whole one)."""
    reserve = geometry.reserved_sms(like, share)
    if not reserve["RESERVED_SMS"]:
        return None, {}
    queue = torch.zeros((C, plan.n_layers, tk.QUEUE_STRIDE), dtype=torch.int32, device=like.device)
    _aten("zero the memory kernel's item counters", phase, _nbytes(queue))
    return queue, reserve
