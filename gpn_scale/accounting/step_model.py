"""Launch, byte and FLOP accounting of a training step on CUDA, and the predicted step time
(the library; `python -m gpn_scale.accounting.gpu_model` is its command, gpu_report.py its
tables).

Nothing is guessed per kernel: the engine's real code path runs on meta tensors at the real
sizes with the CUDA step backend in dry mode (`ops/gpn_step/cuda.py`: every Triton launch is
recorded with its grid, the bytes it must move and its FLOPs, and nothing runs), and every
ATen op of the chunk-wide work (recompute, weight gradients, memory advance, decode, the
loss) is recorded by a dispatch mode with its operands' bytes and matmul FLOPs. The probe
runs two chunks' worth of steps (every per-step and per-chunk cost is linear in T for T a
multiple of the chunk size) and scales to --seq-len.

Each launch is priced by `pricing.py` on the GPU's ceilings (`ceilings.py`: measured by a
committed device run where one exists, else this workplace's or public figures, each printed
with its source): a few-row GEMM at the slowest of its HBM stream (Little's law on its
unique weight bytes in flight), its L2 -> SM traffic and its FLOPs; every other Triton
kernel at its dependent round trips per program (`round_trips.py`, read from its source) x
the loaded latency x the waves its grid needs, plus its bytes; ATen ops at their bytes or
FLOPs. Graphed launches pay the GPU-side gap between kernels (~1.3 us, Hazy Research);
eager ones at least the host's launch cost. With graphs the sequential phases also pay their
replays' copies of each chunk's inputs and outputs into the static buffers.

    python -m gpn_scale.accounting.gpu_model gpn_m_130m --batch 64 --json
    python -m gpn_scale.accounting.gpu_model gpn_m_130m --against docs/device-runs/2026-12-04-h200

Under tensor parallelism (--tp N) the probe is one rank of a tp group: a model of its share
of the heads and FFN hidden units, the CUDA backend's steps split at the group's fixed
points (`ops/gpn_step/collectives.py`), each all-reduce recorded as a collective (priced at
COLLECTIVE_S, a latency) and nothing reduced on meta tensors.

The floor beside it is what any implementation of this algorithm must pay: each sequential
step streams the loop weights (bf16) and every sequence's M0 as the steps read it (float32;
bf16 under `engine.bf16_memory_reads`) once in the forward and once in the reverse sweep
(or its GEMM FLOPs, if larger), and the chunk-wide FLOPs run at peak.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from gpn_scale.accounting import ceilings, device_runs, pricing
from gpn_scale.accounting.ceilings import Ceilings
from gpn_scale.accounting.dry_run import as_tp_rank
from gpn_scale.accounting.kernel_record import SEQUENTIAL, AtenRecorder, Op
from gpn_scale.models.gpn import GPN, ConfigError, GPNConfig, engine
from gpn_scale.models.gpn.counts import flops_per_token
from gpn_scale.models.gpn.loss import ChunkFeed
from gpn_scale.models.gpn.parallelize import check_tp
from gpn_scale.ops import launch as launches_
from gpn_scale.ops.execution import execution
from gpn_scale.ops.gpn_step import phases
from gpn_scale.ops.gpn_step.registry import ENV_VAR
from gpn_scale.ops.gpn_step.workspace import release_workspaces

GPUS: dict[str, Ceilings] = {key: ceilings.for_gpu(key) for key in ceilings.DEFAULTS}
GRAPH_GAP_S = pricing.GRAPH_GAP_S
HOST_LAUNCH_S = pricing.HOST_LAUNCH_S
LAUNCHER_S = pricing.LAUNCHER_S
COLLECTIVE_S = pricing.COLLECTIVE_S
SPLIT_SUM = "(split-K sum)"  # the name suffix of a split GEMM's sum (ops/gpn_step/cuda.py)


@dataclass
class Accounting:
    """What one training step launches, per phase, at `seq_len`: the code path is run at two
    probe lengths (one and two chunks) and every figure extrapolated linearly to seq_len
    (per-window work, e.g. folding the weights, is in both probes alike; per-chunk and
    per-token work grows with T)."""

    config: str
    batch: int
    seq_len: int
    chunk: int
    n_layers: int
    probes: dict[int, list[Op]] = field(default_factory=dict)  # probe T -> its ops
    loop_weight_bytes: int = 0  # bf16
    m0_bytes: int = 0  # per sequence, as the steps read it (float32; bf16 reads: 2 B a cell)
    loop_params: int = 0
    tp: int = 1  # the probe is one rank of a tp group of this size
    compiled: str | None = None  # the target whose compiled facts the ops carry

    def at_seq_len(self, measure) -> float:
        """measure(ops) at each probe, extrapolated linearly to seq_len."""
        (t1, ops1), *rest = sorted(self.probes.items())
        v1 = measure(ops1)
        if not rest:
            return v1 * self.seq_len / t1
        t2, ops2 = rest[0]
        v2 = measure(ops2)
        return v1 + (v2 - v1) * (self.seq_len - t1) / (t2 - t1)

    @property
    def ops(self) -> list[Op]:
        """The longer probe's ops (for listing what runs; figures come from at_seq_len)."""
        return self.probes[max(self.probes)]

    def phases(self) -> list[str]:
        return sorted({op.phase for op in self.ops})

    def per_phase(self) -> dict[str, dict[str, float]]:
        def total(phase: str, what: str) -> float:
            def measure(ops: list[Op]) -> float:
                mine = [op for op in ops if op.phase == phase]
                return len(mine) if what == "launches" else sum(getattr(op, what) for op in mine)

            return self.at_seq_len(measure)

        return {
            ph: {w: total(ph, w) for w in ("launches", "bytes", "flops")} for ph in self.phases()
        }

    def launches_per_step(self, phase: str) -> float:
        """Launches of one time step of `phase`: the CUDA backend's per-step kind, or (the
        PyTorch steps) every op of the phase, per-chunk work included, over its steps."""
        kind = "forward step" if phase == "sequential forward" else "reverse step"

        def count(ops: list[Op]) -> int:
            if any(op.triton for op in ops if op.phase in SEQUENTIAL):
                return sum(
                    1 for op in ops if op.triton and not op.collective and op.name.startswith(kind)
                )
            return sum(1 for op in ops if op.phase == phase and not op.collective)

        return self.at_seq_len(count) / self.seq_len

    def split_sums_per_step(self, phase: str) -> float:
        """Of `launches_per_step`, the split-K sums (one after each GEMM split over K to fill
        the SMs: `ops/gpn_step/gemm.py`, `gemm_plan`)."""
        kind = "forward step" if phase == "sequential forward" else "reverse step"

        def count(ops: list[Op]) -> int:
            return sum(
                1 for op in ops if op.triton and op.name.startswith(kind) and SPLIT_SUM in op.name
            )

        return self.at_seq_len(count) / self.seq_len

    def collectives_per_step(self, phase: str) -> float:
        """All-reduces of the tp group in one time step of `phase` (0 at tp = 1)."""

        def count(ops: list[Op]) -> int:
            return sum(1 for op in ops if op.collective and op.phase == phase)

        return self.at_seq_len(count) / self.seq_len


def account(
    cfg: GPNConfig,
    batch: int,
    seq_len: int,
    name: str = "",
    backend: str = "cuda",
    tp: int = 1,
    compiled: str | None = None,
    jobs: int = 1,
    facts: dict[tuple[str, str], dict] | None = None,
) -> Accounting:
    """Run one training step's code path on meta tensors; record its launches. `backend`:
    "cuda" (the Triton step kernels) or "reference" (the PyTorch steps, what CUDA ran before
    the CUDA backend existed: every ATen op a launch). `tp` > 1: one rank of a tensor-
    parallel group of that size (its heads and FFN share; see the module docstring).
    Every Triton launch carries what its price needs beyond bytes and FLOPs
    (`kernel_costs.KernelCost`: occupancy, round trips per program, GEMM tile geometry).
    `compiled` ("sm_90", "sm_80"): its variant compiled for that target (accounting/
    gpu_compile.py; in `jobs` processes where its facts cache lacks it); None: the facts
    cache, else what a committed device run recorded for the kernel (no compile). `facts`
    (`device_runs.kernel_facts`): a device run's own compiled kernels, priced first."""
    check_tp(cfg, tp, "tp")
    if tp > 1:
        cfg = cfg.replace(n_heads=cfg.n_heads // tp, d_ffn=cfg.d_ffn // tp)
    C = cfg.engine.chunk_size
    lengths = [seq_len] if seq_len <= C else [C, 2 * C]
    acc = Accounting(name or cfg.name, batch, seq_len, C, cfg.n_layers, tp=tp)
    for T in lengths:
        acc.probes[T] = _probe(
            cfg.replace(step_backend=backend), batch, T, backend, tp, compiled, jobs, facts
        )
    acc.compiled = compiled
    d, f, H, dk, dv = cfg.d_state, cfg.d_ffn, cfg.n_heads, cfg.d_key, cfg.d_value
    w_in = sum(d * w for w in _in_widths(cfg))
    w_out = cfg.n_layers * (H * dv + f) * d
    acc.loop_params = w_in + w_out + d * d
    acc.loop_weight_bytes = 2 * acc.loop_params
    # M0 as the steps read it: float32, or bf16 under engine.bf16_memory_reads
    m0_element = 2 if cfg.engine.bf16_memory_reads else 4
    acc.m0_bytes = m0_element * H * dk * dv if cfg.memory else 0
    return acc


def _probe(
    cfg: GPNConfig,
    batch: int,
    T: int,
    backend: str,
    tp: int = 1,
    compiled: str | None = None,
    jobs: int = 1,
    facts: dict[tuple[str, str], dict] | None = None,
) -> list[Op]:
    with torch.device("meta"):
        model = GPN(cfg)
    tokens = torch.zeros(batch, T, dtype=torch.long, device="meta")
    recorder = AtenRecorder(sequential=backend != "cuda")
    # Every probe makes the sweep's adjoint workspaces afresh, as one call does: a probe
    # that found the last one's would record fewer ops, and the two probes' difference
    # (the per-chunk cost) would go negative.
    release_workspaces()
    from gpn_scale.accounting import gpu_compile, kernel_costs

    target = gpu_compile.TARGETS[compiled or "sm_90"]
    # the launches sized for the target the kernels are compiled for (its SMs, its arch)
    sized = dict(assumed_sms=target.sm_count, assumed_arch=target.arch) if compiled else {}
    previous = os.environ.pop(ENV_VAR, None)
    try:
        with (
            launches_.recording(dry=True, keep_args=True) as launches,
            phases.phase_timer(),
            recorder,
            execution(matmul_dtype=torch.bfloat16, **sized),
            as_tp_rank(tp),
        ):
            model(tokens).loss.backward()
    finally:
        if previous is not None:
            os.environ[ENV_VAR] = previous
    costs = kernel_costs.launch_costs(
        list(launches), target, jobs, compile=compiled is not None, recorded=facts
    )
    for launch in launches:  # the records' tensors are not needed past this point
        launch.args, launch.kernel = (), None
    ops = [
        Op(
            f"{launch.phase}: {launch.name}",
            _engine_phase(launch.phase),
            launch.bytes,
            launch.flops,
            True,
            launch.name.startswith(launches_.COLLECTIVE),
            cost,
            dependent=bool(launch.meta.get("PDL")),
            cublas=launch.cublas,
        )
        for launch, cost in zip(launches, costs)
    ]
    return ops + recorder.ops


def _engine_phase(launch_phase: str) -> str:
    if launch_phase.startswith("forward"):
        return "sequential forward"
    if launch_phase.startswith("reverse"):
        return "sequential backward"
    return launch_phase  # a Triton kernel of the chunk-wide work (e.g. "decode")


def _in_widths(cfg: GPNConfig) -> list[int]:
    return [sum(engine.input_column_blocks(cfg, i)) for i in range(cfg.n_layers)]


# Where the side streams' work is taken to find room beside a sweep launch (`_spare`).
PACKED, SPREAD = "packed", "spread"
PLACEMENTS = (PACKED, SPREAD)


@dataclass
class Prediction:
    gpu: Ceilings
    graphs: bool
    seconds: float
    floor_seconds: float
    tokens_per_s: float
    mfu: float
    per_phase_seconds: dict[str, float]
    per_role_seconds: dict[str, float] = field(default_factory=dict)  # launch role -> s/step
    # Of the per-phase seconds, those the backward's side work spends beside the reverse
    # sweep (engine.overlap_backward), not added to `seconds`.
    overlapped_seconds: float = 0.0
    # ... and those the decode spends beside the forward steps (engine.overlap_decode).
    decode_overlapped_seconds: float = 0.0


def role(op_name: str) -> str:
    """A launch's role (what the ledger and a device run name it by): the name without the
    engine phase ("input GEMM 0", "memory/FFN backward 0", "mm")."""
    return op_name.split(": ", 1)[-1]


def gpu_ceilings(gpu: Ceilings | str) -> Ceilings:
    return GPUS[gpu] if isinstance(gpu, str) else gpu


def predict(
    acc: Accounting,
    gpu: Ceilings | str,
    graphs: bool = True,
    cfg: GPNConfig | None = None,
    overlap: bool | None = None,
    overlap_decode: bool | None = None,
    placement: str = PACKED,
) -> Prediction:
    """The step's predicted time on `gpu` (its ceilings; see `pricing.py`), per phase and per
    launch role, beside the floor and the MFU (model FLOPs of `cfg`). `overlap`,
    `overlap_decode`: the engine options (None: `cfg`'s, else on); `placement`: where the side
    streams' work finds room beside a sweep launch (`_spare`)."""
    c = gpu_ceilings(gpu)
    if overlap is None:  # the engine option of the config (default on)
        overlap = cfg.engine.overlap_backward if cfg is not None else True
    if overlap_decode is None:
        overlap_decode = cfg.engine.overlap_decode if cfg is not None else True

    def op_time(op: Op) -> float:
        graphed = graphs and op.triton and op.phase in SEQUENTIAL and not op.collective
        return pricing.price(op, c, graphed, graphs_on=graphs).seconds

    per_phase = {
        ph: acc.at_seq_len(lambda ops, ph=ph: sum(op_time(op) for op in ops if op.phase == ph))
        for ph in acc.phases()
    }
    roles = sorted({role(op.name) for op in acc.ops})
    per_role = {
        r: acc.at_seq_len(lambda ops, r=r: sum(op_time(op) for op in ops if role(op.name) == r))
        for r in roles
    }
    hidden = overlapped(acc, c, per_phase, op_time, placement) if overlap else 0.0
    rows = cfg.engine.loss_chunk_tokens if cfg is not None else 1024
    hidden_decode = (
        decode_overlapped(acc, c, per_phase, op_time, rows, placement)
        if overlap_decode and acc.tp == 1  # under tp the engine decodes inline
        else 0.0
    )
    seconds = sum(per_phase.values()) - hidden - hidden_decode
    B, T = acc.batch, acc.seq_len
    step_stream = (acc.loop_weight_bytes + B * acc.m0_bytes) / c.copy_bytes_per_s
    step_flops = 2 * B * acc.loop_params / c.matmul_flops_per_s
    chunk_flops = acc.at_seq_len(
        lambda ops: sum(op.flops for op in ops if op.phase not in SEQUENTIAL)
    )
    floor = 2 * T * max(step_stream, step_flops) + chunk_flops / c.matmul_flops_per_s
    tokens_per_s = B * T / seconds
    model_flops = flops_per_token(cfg, T) if cfg is not None else 0.0
    return Prediction(
        c,
        graphs,
        seconds,
        floor,
        tokens_per_s,
        model_flops * tokens_per_s / c.datasheet_bf16_flops_per_s,
        per_phase,
        per_role,
        hidden,
        hidden_decode,
    )


# The backward's side work (ops/gpn_step/overlap.py): beside the reverse sweep on a second
# stream, except the first chunk's recompute and the last one's weight gradients.
SIDE_WORK = ("parallel recompute", "weight gradients")


def overlapped(
    acc: Accounting, c: Ceilings, per_phase: dict[str, float], op_time, placement: str = PACKED
) -> float:
    """Seconds of side work hidden behind the reverse sweep: up to the SM time its launches
    leave free (`_spare`), but the first chunk's recompute and the last one's weight
    gradients, which nothing runs beside. Predicted, not yet measured: the device check
    times the first config with overlap off beside it."""
    chunks = max(1, math.ceil(acc.seq_len / acc.chunk))
    side = sum(per_phase.get(ph, 0.0) for ph in SIDE_WORK) * (chunks - 1) / chunks
    spare = acc.at_seq_len(lambda ops: _spare(ops, "sequential backward", c, op_time, placement))
    return min(side, spare)


def decode_pieces(batch: int, seq_len: int, chunk: int, rows: int) -> int:
    """How many pieces the engine's decode is fed in (models/gpn/loss.py's ChunkFeed)."""
    pieces, first = 0, 0
    for end in [*range(chunk, seq_len, chunk), seq_len]:
        if ChunkFeed.ends_piece(batch, first, end, seq_len, rows):
            pieces, first = pieces + 1, end
    return pieces


def decode_overlapped(
    acc: Accounting,
    c: Ceilings,
    per_phase: dict[str, float],
    op_time,
    rows: int,
    placement: str = PACKED,
) -> float:
    """Seconds of the decode hidden behind the forward steps (engine.overlap_decode): each
    piece but the last runs beside the next chunks' steps, up to the SM time they leave free.
    Predicted, not yet measured: the device check times it off beside on."""
    pieces = decode_pieces(acc.batch, acc.seq_len, acc.chunk, rows)
    side = per_phase.get("decode", 0.0) * (pieces - 1) / pieces
    spare = acc.at_seq_len(lambda ops: _spare(ops, "sequential forward", c, op_time, placement))
    return min(side, spare)


def _spare(ops: list[Op], sweep: str, c: Ceilings, op_time, placement: str = PACKED) -> float:
    """The SM time a sweep's launches leave to side work. Its GEMMs are taken to run only on
    SMs no program of the sweep's current launch holds (a sweep program keeps most of an SM's
    registers: memory backward at 2 programs per SM uses all of them), and in the gaps
    between the sweep's launches; what does not fit there is added to the step. Which SMs a
    launch holds (`placement`): PACKED, its programs at their programs per SM on as few SMs
    as they fill (what this has priced since the side streams came; the free slots of the
    SMs they hold, by another name); SPREAD, one SM per program up to all of them, as a
    block scheduler that fills the SMs breadth-first places them, and no side work beside a
    sweep program. The device check's overlap A/B measures which (`gpu_report.engine_ab`)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement: expected one of {', '.join(PLACEMENTS)}, got {placement!r}")
    total = 0.0
    for op in ops:
        if op.phase != sweep:
            continue
        free = 0.0
        if op.cost is not None and op.cost.blocks_per_sm:
            packed = math.ceil(op.cost.programs / op.cost.blocks_per_sm)
            kept = c.sm_count - op.cost.reserved_sms  # a launch that leaves SMs keeps these
            busy = min(kept, packed if placement == PACKED else op.cost.programs)
            free = 1 - busy / c.sm_count
        gap = pricing.gap_s(op)
        total += gap + max(0.0, op_time(op) - gap) * free
    return total


@dataclass
class Baseline:
    """The predicted step of the model users would otherwise train (accounting/baseline_model):
    eager (`ops`) and as torch.compile runs it (`compiled_ops`: compile.enable)."""

    config: str
    ops: list[Op]
    batch: int
    seq_len: int
    flops_per_token: float
    compiled_ops: list[Op] = field(default_factory=list)

    def seconds(self, gpu: Ceilings | str, compiled: bool = True) -> float:
        acc = Accounting(self.config, self.batch, self.seq_len, self.seq_len, 0)
        acc.probes[self.seq_len] = self.compiled_ops if compiled and self.compiled_ops else self.ops
        return predict(acc, gpu, graphs=False).seconds

    def tokens_per_s(self, gpu: Ceilings | str, compiled: bool = True) -> float:
        return self.batch * self.seq_len / self.seconds(gpu, compiled)

    def mfu(self, gpu: Ceilings | str, compiled: bool = True) -> float:
        c = gpu_ceilings(gpu)
        return self.flops_per_token * self.tokens_per_s(c, compiled) / c.datasheet_bf16_flops_per_s


def baseline_for(cfg: GPNConfig) -> Any:
    """The Transformer++ priced beside a GPN by default: the one the device check trains
    beside it (`baseline_model.matched_transformer`), so that the predicted ratio and the
    measured one compare the same two models."""
    from gpn_scale.accounting.baseline_model import matched_transformer

    try:
        return matched_transformer(cfg)
    except ValueError as exc:
        raise ConfigError(
            f"--baseline auto: {exc}; name the model to price beside it (e.g. --baseline "
            "transformer_pp_10m) or --baseline none"
        ) from exc


def account_baseline(model: Any, batch: int, seq_len: int) -> Baseline:
    """The Transformer++ `model` (a config name, e.g. transformer_pp_130m, or a
    TransformerPPConfig) at (batch, seq_len), eager and compiled."""
    from gpn_scale.accounting.baseline_model import fused, transformer_step_ops
    from gpn_scale.models.registry import family_of
    from gpn_scale.models.registry import load_model_config as load_family_config

    if isinstance(model, str):
        spec, cfg = load_family_config(model)
    else:
        spec, cfg = family_of(model), model
    if spec.launch_accounting:  # priced by this module's own accounting, not beside it
        raise ConfigError(
            f"--baseline {model}: a {spec.display_name} config, the family priced here; name "
            "the model it is compared with (e.g. transformer_pp_130m, gated_deltanet_130m)"
        )
    ops = transformer_step_ops(cfg, batch, seq_len)
    flops = spec.flops_per_token(cfg, seq_len)
    return Baseline(cfg.name or str(model), ops, batch, seq_len, flops, fused(ops))


def predicted_mfu(cfg: GPNConfig, sequences_per_gpu: int, seq_len: int, gpu: str = "h100") -> float:
    """The MFU the accounting predicts (graphs on): what `gpn-scale sweep plan` prices with
    unless a sweep gives a measured `hardware.mfu`. No kernel is compiled: the facts cache,
    else the kernels a committed device run recorded (`kernel_costs`); the ceilings are the
    newest device run's where it measured them (`ceilings.for_gpu`)."""
    acc = account(cfg, sequences_per_gpu, seq_len)
    return predict(acc, GPUS[gpu], graphs=True, cfg=cfg).mfu


def pricing_basis(gpu: str) -> str:
    """One line: what a prediction on `gpu` rests on (for `sweep plan` and the report)."""
    c = GPUS[gpu]
    measured = sorted({src for src in c.sources.values() if src.startswith("measured")})
    facts_run = device_runs.newest_kernel_facts()[1]
    return (
        f"calibrated accounting ({c.name}: "
        + (
            "; ".join(measured)
            if measured
            else "ceilings from this workplace's and public "
            "figures, no device run measured them yet"
        )
        + (f"; kernel facts of device run {facts_run}" if facts_run else "")
        + ")"
    )
