"""Launch, byte and FLOP accounting of a training step on CUDA, and the predicted step time.

    python -m gpn_scale.accounting.gpu_model gpn_m_130m --batch 64 --seq-len 2048

Nothing is guessed per kernel: the engine's real code path runs on meta tensors at the real
sizes with the CUDA step backend in dry mode (`ops/gpn_step/cuda.py`: every Triton launch is
recorded with its grid, the bytes it must move and its FLOPs, and nothing runs), and every
ATen op of the chunk-wide work (recompute, weight gradients, memory advance, decode, the
loss) is recorded by a dispatch mode with its operands' bytes and matmul FLOPs. The probe
runs two chunks' worth of steps (every per-step and per-chunk cost is linear in T for T a
multiple of the chunk size) and scales to --seq-len.

The prediction per launch is max(bytes / (eff_bw * HBM bandwidth), FLOPs / (eff_flops *
dense bf16 peak)) plus the GPU-side gap between kernels (~1.3 us on H100 even under graphs:
Hazy Research, "no bubbles"); launched eagerly, at least the host's launch cost (~5 us: a
phase is host-bound where its kernels are shorter). With graphs the sequential phases also
pay their replays' copies of each chunk's inputs and outputs into the static buffers.

Under tensor parallelism (--tp N) the probe is one rank of a tp group: a model of its share
of the heads and FFN hidden units, the CUDA backend's steps split at the group's fixed
points (`ops/gpn_step/collectives.py`), each all-reduce recorded as a collective (priced at
COLLECTIVE_S, a latency) and nothing reduced on meta tensors.

The floor beside it is what any implementation of this algorithm must pay: each sequential
step streams the loop weights (bf16) and every sequence's float32 M0 once in the
forward and once in the reverse sweep (or its GEMM FLOPs, if larger), and the chunk-wide
FLOPs run at peak.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field

import torch

from gpn_scale.accounting.dry_run import as_tp_rank
from gpn_scale.accounting.kernel_record import SEQUENTIAL, AtenRecorder, Op
from gpn_scale.models.gpn import GPN, GPNConfig, engine, load_model_config
from gpn_scale.models.gpn.config import ConfigError
from gpn_scale.models.gpn.counts import flops_per_token
from gpn_scale.models.gpn.parallelize import check_tp
from gpn_scale.ops import launch as launches_
from gpn_scale.ops.execution import execution
from gpn_scale.ops.gpn_step import phases
from gpn_scale.ops.gpn_step.cuda import GRAPH_COPIES
from gpn_scale.ops.gpn_step.registry import ENV_VAR


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float  # dense
    sm_count: int = 132
    arch: str = "sm_90"  # what accounting/gpu_compile compiles its kernels for


GPUS = {
    "h100": Gpu("H100 SXM", 3.35e12, 989e12),
    "h200": Gpu("H200", 4.8e12, 989e12),
}
GRAPH_GAP_S = 1.3e-6  # between two kernels of a replayed graph, on the GPU
HOST_LAUNCH_S = 5e-6  # host time to issue one eager launch (dispatch included)
# With the compiled kernels' facts (`account(..., compiled=True)`), an eager Triton launch
# costs the host its argument binding, measured (accounting/gpu_compile.binding_seconds: 16 us a
# GEMM, 45-85 us the memory backward's 93 arguments, on this 2-core machine), plus the
# launcher and the driver's call:
LAUNCHER_S = 4e-6
# HBM3's latency under load (~600-800 ns idle): to stream at bandwidth, bandwidth x latency
# bytes must be in flight (4.8 MB on an H200, ~36 KB per SM). A GEMM whose grid keeps fewer
# in flight (few programs, or tiles not pipelined) streams its weight at the share it keeps.
HBM_LATENCY_S = 1.0e-6
# A small-message NCCL all-reduce on 8 NVLink GPUs (latency-bound; accounting/tp_model.py's figure)
COLLECTIVE_S = 25e-6
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
    m0_bytes: int = 0  # per sequence, float32
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
        the SMs: `ops/gpn_step/cuda.py`, `gemm_plan`)."""
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
) -> Accounting:
    """Run one training step's code path on meta tensors; record its launches. `backend`:
    "cuda" (the Triton step kernels) or "reference" (the PyTorch steps, what CUDA ran before
    the CUDA backend existed: every ATen op a launch). `tp` > 1: one rank of a tensor-
    parallel group of that size (its heads and FFN share; see the module docstring).
    `compiled` ("sm_90", "sm_80"): every Triton launch also carries the facts of its
    variant compiled for that target (accounting/gpu_compile.py; compiled in `jobs` processes
    where its cache does not hold them), which `predict` then charges."""
    check_tp(cfg, tp, "tp")
    if tp > 1:
        cfg = cfg.replace(n_heads=cfg.n_heads // tp, d_ffn=cfg.d_ffn // tp)
    C = cfg.engine.chunk_size
    lengths = [seq_len] if seq_len <= C else [C, 2 * C]
    acc = Accounting(name or cfg.name, batch, seq_len, C, cfg.n_layers, tp=tp)
    for T in lengths:
        acc.probes[T] = _probe(
            cfg.replace(step_backend=backend), batch, T, backend, tp, compiled, jobs
        )
    acc.compiled = compiled
    d, f, H, dk, dv = cfg.d_state, cfg.d_ffn, cfg.n_heads, cfg.d_key, cfg.d_value
    w_in = sum(d * w for w in _in_widths(cfg))
    w_out = cfg.n_layers * (H * dv + f) * d
    acc.loop_params = w_in + w_out + d * d
    acc.loop_weight_bytes = 2 * acc.loop_params
    acc.m0_bytes = 4 * H * dk * dv if cfg.memory else 0
    return acc


def _probe(
    cfg: GPNConfig,
    batch: int,
    T: int,
    backend: str,
    tp: int = 1,
    compiled: str | None = None,
    jobs: int = 1,
) -> list[Op]:
    with torch.device("meta"):
        model = GPN(cfg)
    tokens = torch.zeros(batch, T, dtype=torch.long, device="meta")
    recorder = AtenRecorder(sequential=backend != "cuda")
    previous = os.environ.pop(ENV_VAR, None)
    try:
        with (
            launches_.recording(dry=True, keep_args=compiled is not None) as launches,
            phases.phase_timer(),
            recorder,
            execution(matmul_dtype=torch.bfloat16),
            as_tp_rank(tp),
        ):
            model(tokens).loss.backward()
    finally:
        if previous is not None:
            os.environ[ENV_VAR] = previous
    costs: list = [None] * len(launches)
    if compiled is not None:
        from gpn_scale.accounting import gpu_compile

        costs = gpu_compile.launch_costs(list(launches), gpu_compile.TARGETS[compiled], jobs)
    ops = [
        Op(
            f"{launch.phase}: {launch.name}",
            _engine_phase(launch.phase),
            launch.bytes,
            launch.flops,
            True,
            launch.name.startswith(launches_.COLLECTIVE),
            cost,
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


@dataclass
class Prediction:
    gpu: Gpu
    graphs: bool
    seconds: float
    floor_seconds: float
    tokens_per_s: float
    mfu: float
    per_phase_seconds: dict[str, float]


EFF_BW = 0.8
EFF_FLOPS = 0.7


def predict(
    acc: Accounting,
    gpu: Gpu,
    graphs: bool = True,
    eff_bw: float = EFF_BW,
    eff_flops: float = EFF_FLOPS,
    cfg: GPNConfig | None = None,
) -> Prediction:
    def op_time(op: Op) -> float:
        if op.name.endswith(GRAPH_COPIES) and not graphs:
            return 0.0
        if op.collective:
            return COLLECTIVE_S
        graphed = graphs and op.triton and op.phase in SEQUENTIAL
        if op.cost is not None:
            return _compiled_time(op, gpu, eff_bw, eff_flops, graphed)
        t = (
            max(
                op.bytes / (eff_bw * gpu.hbm_bytes_per_s),
                op.flops / ((op.efficiency or eff_flops) * gpu.bf16_flops_per_s),
            )
            + GRAPH_GAP_S
        )
        # Only the sequential phases replay as graphs; everything else launches eagerly and
        # is host-bound where its kernels are shorter than their launch.
        return t if graphed else max(t, HOST_LAUNCH_S)

    per_phase = {
        ph: acc.at_seq_len(lambda ops, ph=ph: sum(op_time(op) for op in ops if op.phase == ph))
        for ph in acc.phases()
    }
    seconds = sum(per_phase.values())
    B, T = acc.batch, acc.seq_len
    step_stream = (acc.loop_weight_bytes + B * acc.m0_bytes) / gpu.hbm_bytes_per_s
    step_flops = 2 * B * acc.loop_params / gpu.bf16_flops_per_s
    chunk_flops = acc.at_seq_len(
        lambda ops: sum(op.flops for op in ops if op.phase not in SEQUENTIAL)
    )
    floor = 2 * T * max(step_stream, step_flops) + chunk_flops / gpu.bf16_flops_per_s
    tokens_per_s = B * T / seconds
    model_flops = flops_per_token(cfg, T) if cfg is not None else 0.0
    return Prediction(
        gpu,
        graphs,
        seconds,
        floor,
        tokens_per_s,
        model_flops * tokens_per_s / gpu.bf16_flops_per_s,
        per_phase,
    )


@dataclass
class Baseline:
    """The predicted step of the model users would otherwise train (accounting/baseline_model)."""

    config: str
    ops: list[Op]
    batch: int
    seq_len: int
    flops_per_token: float

    def seconds(self, gpu: Gpu) -> float:
        acc = Accounting(self.config, self.batch, self.seq_len, self.seq_len, 0)
        acc.probes[self.seq_len] = self.ops
        return predict(acc, gpu, graphs=False).seconds

    def tokens_per_s(self, gpu: Gpu) -> float:
        return self.batch * self.seq_len / self.seconds(gpu)


def baseline_for(config: str) -> str:
    """The Transformer++ of the same ladder size as a GPN config name (gpn_m_130m_2l ->
    transformer_pp_130m)."""
    size = config.removesuffix("_2l").split("_")[-1]
    return f"transformer_pp_{size}"


def account_baseline(name: str, batch: int, seq_len: int) -> Baseline:
    from gpn_scale.accounting.baseline_model import transformer_step_ops
    from gpn_scale.models.registry import load_model_config as load_family_config

    spec, cfg = load_family_config(name)
    return Baseline(
        name,
        transformer_step_ops(cfg, batch, seq_len),
        batch,
        seq_len,
        spec.flops_per_token(cfg, seq_len),
    )


def bandwidth_share(cost, gpu: Gpu) -> float:
    """The share of the GPU's bandwidth one launch can draw, from its compiled variant:
    - a GEMM (its in-flight bytes known): Little's law, the bytes its resident programs keep
      in flight over what bandwidth x latency needs (few programs, or tiles read through
      registers instead of pipelined, stream at that share);
    - any other kernel: the SMs its programs occupy (a grid smaller than the GPU leaves SMs
      idle), and the last wave's tail (programs / (SMs x CTAs per SM) waves, rounded up)."""
    resident = min(cost.programs, gpu.sm_count * cost.blocks_per_sm)
    if cost.in_flight:
        return min(1.0, resident * cost.in_flight / (gpu.hbm_bytes_per_s * HBM_LATENCY_S))
    if cost.programs <= gpu.sm_count:
        return cost.programs / gpu.sm_count
    waves = cost.programs / (gpu.sm_count * cost.blocks_per_sm)
    return waves / math.ceil(waves) if waves > 1 else 1.0


def _compiled_time(op: Op, gpu: Gpu, eff_bw: float, eff_flops: float, graphed: bool) -> float:
    """A Triton launch priced with what the compiler made of it: its bytes plus its spill
    traffic (local memory, charged as HBM bytes: an upper bound, L1 catches some) at its
    share of the bandwidth, its FLOPs, the gap between kernels; launched eagerly, at least
    the host's measured binding plus the launcher."""
    c = op.cost
    moved = op.bytes + c.programs * c.threads * c.spill_bytes
    t = (
        max(
            moved / (eff_bw * gpu.hbm_bytes_per_s * max(bandwidth_share(c, gpu), 1e-3)),
            op.flops / (eff_flops * gpu.bf16_flops_per_s),
        )
        + GRAPH_GAP_S
    )
    return t if graphed else max(t, c.host_s + LAUNCHER_S)


def predicted_mfu(cfg: GPNConfig, sequences_per_gpu: int, seq_len: int, gpu: str = "h100") -> float:
    """The MFU the accounting predicts (graphs on): what `gpn-scale sweep plan` prices with
    unless a sweep gives a measured `hardware.mfu`."""
    acc = account(cfg, sequences_per_gpu, seq_len)
    return predict(acc, GPUS[gpu], graphs=True, cfg=cfg).mfu


def _launches(acc: Accounting, phase: str) -> str:
    sums = acc.split_sums_per_step(phase)
    kernels = acc.launches_per_step(phase) - sums
    return f"{kernels:.0f}" + (f" + {sums:.0f} split-K sums" if sums else "")


def report(
    acc: Accounting,
    cfg: GPNConfig,
    gpus: list[str],
    before: Accounting | None = None,
    baseline: Baseline | None = None,
) -> str:
    lines = [
        f"# GPU accounting: {acc.config}, batch {acc.batch}, T = {acc.seq_len}, chunk "
        f"{acc.chunk}, {acc.n_layers} layer(s) (bf16 autocast; probes of "
        f"{' and '.join(map(str, sorted(acc.probes)))} steps, extrapolated)",
        "",
        f"Launches per time step (CUDA backend): forward {_launches(acc, SEQUENTIAL[0])}, "
        f"reverse sweep {_launches(acc, SEQUENTIAL[1])}",
        *(
            [
                f"Tensor parallelism: one rank of tp = {acc.tp}; all-reduces per time step: "
                f"forward {acc.collectives_per_step('sequential forward'):.0f}, reverse sweep "
                f"{acc.collectives_per_step('sequential backward'):.0f} (each priced at "
                f"{COLLECTIVE_S * 1e6:.0f} us)"
            ]
            if acc.tp > 1
            else []
        ),
        "",
        "| phase | launches | GB moved | GFLOP |",
        "|---|---|---|---|",
    ]
    for phase, row in sorted(acc.per_phase().items(), key=lambda kv: -kv[1]["bytes"]):
        lines.append(
            f"| {phase} | {row['launches']:,.0f} | {row['bytes'] / 1e9:,.2f} | "
            f"{row['flops'] / 1e9:,.1f} |"
        )
    rows = [(f"CUDA backend, graphs {'on' if g else 'off'}", acc, g) for g in (True, False)]
    if before is not None:
        rows.append(("PyTorch steps (eager)", before, False))
        lines += [
            "",
            f"PyTorch steps, for comparison: {before.launches_per_step(SEQUENTIAL[0]):.0f}"
            f" forward / {before.launches_per_step(SEQUENTIAL[1]):.0f} reverse launches per "
            "step (per-chunk work included)",
        ]
    phases = sorted(acc.per_phase(), key=lambda ph: -acc.per_phase()[ph]["bytes"])
    lines += [
        "",
        "| GPU | path | predicted s/step | floor s/step | floor / predicted | "
        "tokens/s | MFU | " + " | ".join(phases) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(phases),
    ]
    for key in gpus:
        for label, a, graphs in rows:
            p = predict(a, GPUS[key], graphs=graphs, cfg=cfg)
            lines.append(
                f"| {p.gpu.name} | {label} | {p.seconds:.3f} | {p.floor_seconds:.3f} | "
                f"{p.floor_seconds / p.seconds:.0%} | {p.tokens_per_s:,.0f} | "
                f"{p.mfu:.1%} | "
                + " | ".join(f"{p.per_phase_seconds.get(ph, 0):.3f}" for ph in phases)
                + " |"
            )
    if baseline is not None:
        lines += [
            "",
            f"Beside what users would otherwise train: {baseline.config} (eager PyTorch, bf16, "
            f"flash attention), the same batch and T (accounting/baseline_model.py):",
            "",
            "| GPU | GPN+M tokens/s (best path) | Transformer++ s/step | Transformer++ "
            "tokens/s | Transformer++ MFU | GPN+M / Transformer++ |",
            "|---|---|---|---|---|---|",
        ]
        for key in gpus:
            gpu = GPUS[key]
            best = max(predict(acc, gpu, graphs=g, cfg=cfg).tokens_per_s for g in (True, False))
            tpp = baseline.tokens_per_s(gpu)
            mfu = baseline.flops_per_token * tpp / gpu.bf16_flops_per_s
            lines.append(
                f"| {gpu.name} | {best:,.0f} | {baseline.seconds(gpu):.3f} | {tpp:,.0f} | "
                f"{mfu:.1%} | {best / tpp:.2f} |"
            )
    compiled = (
        f" Triton launches priced with their kernels compiled for {acc.compiled} "
        f"(accounting/gpu_compile.py): spill traffic, the bandwidth share their grid and pipelined "
        f"tiles can draw ({HBM_LATENCY_S * 1e6:.1f} us HBM latency under load), the host's "
        f"measured argument binding + {LAUNCHER_S * 1e6:.0f} us per eager launch."
        if acc.compiled
        else ""
    )
    lines += [
        "",
        f"Assumptions: {EFF_BW:.0%} of HBM bandwidth and {EFF_FLOPS:.0%} of dense bf16 "
        f"peak reached per kernel; {GRAPH_GAP_S * 1e6:.1f} us between graphed kernels; "
        f"{HOST_LAUNCH_S * 1e6:.0f} us host time per eager ATen launch.{compiled}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="model config name or path (e.g. gpn_m_130m)")
    parser.add_argument("--batch", type=int, default=64, help="sequences per GPU (default 64)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (2048)")
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="override the config's chunk_size (default: the config's)",
    )
    parser.add_argument(
        "--gpu", default="h100,h200", help=f"comma-separated, of {', '.join(GPUS)} (default both)"
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        help="account one rank of a tensor-parallel group of this size (default 1)",
    )
    parser.add_argument(
        "--compiled",
        default="auto",
        help="price each Triton launch with its kernel compiled for this target (sm_90, "
        "sm_80; accounting/gpu_compile.py, its facts cached in .cache/gpu-compile), 'none', or "
        "'auto' (sm_90, unless this process runs Triton's interpreter)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument(
        "--baseline",
        default="auto",
        help="the Transformer++ config priced beside it ('auto': the same ladder size, "
        "'none': skip)",
    )
    args = parser.parse_args(argv)
    gpus = [g.strip().lower() for g in args.gpu.split(",") if g.strip()]
    unknown = [g for g in gpus if g not in GPUS]
    if unknown or args.batch < 1 or args.seq_len < 1 or args.tp < 1:
        problem = f"unknown GPU {unknown[0]}" if unknown else "batch, seq-len and tp must be >= 1"
        print(
            f"gpu_model: {problem} (GPUs: {', '.join(GPUS)})",
            file=sys.stderr,
        )
        return 2
    cfg = load_model_config(args.config)
    if args.chunk_size is not None:
        cfg = cfg.replace(chunk_size=args.chunk_size)
    compiled: str | None = args.compiled.lower()
    if compiled == "auto":
        compiled = None if os.environ.get("TRITON_INTERPRET") == "1" else "sm_90"
    elif compiled == "none":
        compiled = None
    if compiled is not None and compiled not in ("sm_90", "sm_80"):
        print(f"gpu_model: --compiled {compiled!r}: expected sm_90, sm_80 or none", file=sys.stderr)
        return 2
    try:
        acc = account(
            cfg,
            args.batch,
            args.seq_len,
            args.config,
            tp=args.tp,
            compiled=compiled,
            jobs=max(1, args.jobs),
        )
        baseline = None
        if args.baseline.lower() != "none":
            name = baseline_for(args.config) if args.baseline == "auto" else args.baseline
            baseline = account_baseline(name, args.batch, args.seq_len)
    except ConfigError as exc:
        print(f"gpu_model: {exc}", file=sys.stderr)
        return 2
    before = account(cfg, args.batch, args.seq_len, args.config, backend="reference", tp=args.tp)
    print(report(acc, cfg, gpus, before, baseline))
    return 0


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # --compiled compiles the kernels themselves
    sys.exit(main())
