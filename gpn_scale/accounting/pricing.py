"""The price of one recorded launch on one GPU: seconds, and which ceiling bounds it.

Three kinds of launch, three physical models (the ceilings and their sources:
`ceilings.py`; the launch's facts: `kernel_costs.py`):

- **A few-row GEMM** (`linear_kernel`: the batch's rows against a weight streamed once) is
  the slowest of three rates:
  - HBM: its bytes at the copy bandwidth, drawn at the share its unique weight bytes in flight
    cover (Little's law: copy bandwidth x latency bytes must be in flight; programs reading
    the same weight tile, the grid's row blocks, count once: the second is an L2 hit), wave
    by wave (a last partial wave keeps fewer bytes in flight);
  - L2 -> SMs: every program's A rows and weight tiles at the L2 bandwidth (the float32 A
    operand is read again by every column tile), or the most loaded SM's at one SM's;
  - its FLOPs at the GEMM rate;
  plus one latency for the pipeline to fill.
- **Any other Triton kernel** runs at the latency of its memory accesses: each program's
  dependent round trips (`round_trips.py`, from the kernel's source) x the latency, its
  programs placed on the resident slots (SMs x programs per SM) as the block scheduler
  does, plus its bytes at what the SMs it occupies can draw (and spill traffic); a memory
  backward that leaves SMs to the side stream, on the SMs it keeps.
- **An ATen op** (the chunk-wide work, outside the sequential steps): its bytes at the copy
  bandwidth or its FLOPs at the GEMM rate (flash attention at its own share of the peak); a
  step GEMM through cuBLAS (engine.cublas_gemms) its bytes at the share of the copy
  bandwidth cuBLAS reaches at the step's shapes (`Ceilings.cublas_step_share`).

Graphed launches pay the GPU-side gap between kernels (a dependent launch a shorter one);
eager ones at least the host's time.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpn_scale.accounting import round_trips
from gpn_scale.accounting.ceilings import Ceilings
from gpn_scale.accounting.kernel_record import Op

GRAPH_GAP_S = 1.3e-6  # between two kernels of a replayed graph, on the GPU (Hazy Research)
# ... before a programmatic dependent launch (engine.dependent_launch): its programs are
# already on the SMs, waiting, when the kernel before ends; what is left is that kernel's
# completion reaching them. Assumed, not measured: the device check times the engine with
# dependent launches off beside on.
DEPENDENT_GAP_S = 0.5e-6
HOST_LAUNCH_S = 5e-6  # host time to issue one eager ATen launch (dispatch included)
# An eager Triton launch costs the host its argument binding, measured
# (kernel_costs.binding_seconds: 16 us a GEMM, 45-85 us the memory backward's 93 arguments,
# on a 2-core development machine), plus the launcher and the driver's call:
LAUNCHER_S = 4e-6
# A small-message NCCL all-reduce on 8 NVLink GPUs (latency-bound; tp_model.py's figure)
COLLECTIVE_S = 25e-6
GRAPH_COPIES = "graph copies in/out"  # ops/gpn_step/cuda.py's record of a replay's copies


@dataclass(frozen=True)
class Price:
    seconds: float
    bound: str  # what limits it: hbm | l2 | flops | latency | host | collective | copy
    hbm_seconds: float = 0.0  # its bytes alone at the copy bandwidth (for shares)


def price(op: Op, c: Ceilings, graphed: bool, graphs_on: bool = True) -> Price:
    """One launch's time on the GPU of `c`; `graphed`: replayed inside a CUDA graph."""
    if op.name.endswith(GRAPH_COPIES):
        if not graphs_on:
            return Price(0.0, "copy")
        t = op.bytes / c.copy_bytes_per_s
        return Price(t + GRAPH_GAP_S, "copy", t)
    if op.collective:
        return Price(COLLECTIVE_S, "collective")
    hbm = op.bytes / c.copy_bytes_per_s
    if op.cost is not None:
        t, bound = _triton(op, c)
        host = op.cost.host_s + LAUNCHER_S
    else:
        rate = (
            op.efficiency * c.datasheet_bf16_flops_per_s if op.efficiency else c.matmul_flops_per_s
        )
        # a step GEMM through cuBLAS draws the share of the copy bandwidth it was measured at
        streamed = hbm / c.cublas_step_share if op.cublas else hbm
        t, bound = max((streamed, "hbm"), (op.flops / rate, "flops"))
        host = HOST_LAUNCH_S
    t += gap_s(op)
    if not graphed and host > t:
        return Price(host, "host", hbm)
    return Price(t, bound, hbm)


def gap_s(op: Op) -> float:
    """The GPU-side gap before a launch: a dependent launch's or a graph's."""
    return DEPENDENT_GAP_S if op.dependent else GRAPH_GAP_S


def _triton(op: Op, c: Ceilings) -> tuple[float, str]:
    k = op.cost
    if k.in_flight:
        return _gemm(op, c)
    sms = max(1, c.sm_count - k.reserved_sms)  # those it does not leave to the side stream
    slots = sms * k.blocks_per_sm
    per_class = tuple(
        t * c.latency_s
        + (issue_seconds(k, k.issued[j], c) if j < len(k.issued) else 0.0)
        + pipeline_waits(k, j, c)
        for j, t in enumerate(k.trips)
    )
    durations = tuple(round_trips.program_durations(per_class, k.grid or (k.programs,), 1.0))
    latency = round_trips.makespan(durations, slots)
    active = min(sms, k.programs)
    draw = min(c.copy_bytes_per_s, active * c.l2_one_sm_bytes_per_s)
    moved = op.bytes + k.programs * k.threads * k.spill_bytes
    transfer = moved / draw
    flops = op.flops / c.matmul_flops_per_s
    t = latency + max(transfer, flops)
    return t, "latency" if latency >= transfer else "hbm"


def issue_seconds(k, issued: float, c: Ceilings) -> float:
    """The time one program spends issuing its instructions (`issued` warp-instructions),
    between its round trips: each warp's stream at one instruction per scheduler slot it
    shares with the SM's resident warps, and no faster than the dependent-issue latency
    (few warps cannot hide it: with 1-2 warps per scheduler a warp issues every 4 cycles)."""
    warps = max(1, k.threads // 32)
    per_scheduler = warps * k.blocks_per_sm / c.schedulers_per_sm
    cycles_per_instruction = max(per_scheduler, c.dependent_issue_cycles)
    return issued / warps * cycles_per_instruction / c.sm_clock_hz


def pipeline_waits(k, j: int, c: Ceilings) -> float:
    """What a program of class `j` waits in its software-pipelined loops beyond its round
    trips: an iteration's loads were issued stages - 1 iterations ahead, so an iteration
    takes at least a round trip over that many; a body that issues faster waits the rest
    (the walk, round_trips.py, counts those iterations' loads as ready)."""
    warps = max(1, k.threads // 32)
    loops = k.pipelined[j] if j < len(k.pipelined) else ()
    return sum(
        ahead * max(0.0, c.latency_s / (stages - 1) - issue_seconds(k, body * warps, c))
        for ahead, body, stages in loops
    )


def gemm_hbm_share(k, c: Ceilings, resident: int | None = None) -> float:
    """The share of the copy bandwidth a GEMM's grid can draw: its unique weight bytes in
    flight over bandwidth x latency (Little's law), with `resident` programs running (all
    that fit, by default)."""
    if resident is None:
        resident = min(k.programs, c.sm_count * k.blocks_per_sm)
    unique = resident * k.in_flight / max(1, min(k.m_blocks, resident))
    return min(1.0, unique / (c.copy_bytes_per_s * c.latency_s))


def _gemm(op: Op, c: Ceilings) -> tuple[float, str]:
    """A grid that is not a whole number of waves streams its last wave with fewer programs
    in flight (each wave at its own share); a grid that is not a multiple of the SMs loads
    some SMs with one program more, whose A and weight tiles come through one SM's L2 port."""
    k = op.cost
    moved = op.bytes + k.programs * k.threads * k.spill_bytes
    slots = c.sm_count * k.blocks_per_sm
    hbm, left = 0.0, k.programs
    while left > 0:
        wave = min(left, slots)
        share = max(gemm_hbm_share(k, c, wave), 1e-3)
        hbm += moved * wave / k.programs / (c.copy_bytes_per_s * share)
        left -= wave
    per_sm = -(-k.programs // c.sm_count) * k.l2_bytes / k.programs
    l2 = max(k.l2_bytes / c.l2_bytes_per_s, per_sm / c.l2_one_sm_bytes_per_s)
    terms = ((hbm, "hbm"), (l2, "l2"), (op.flops / c.matmul_flops_per_s, "flops"))
    t, bound = max(terms)
    return t + c.latency_s, bound
