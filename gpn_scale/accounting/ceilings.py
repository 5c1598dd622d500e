"""What one GPU can do, as the launch accounting prices with it: each figure with its source.

A figure measured by a committed device run (`docs/device-runs/<date>-<gpu>/results.json`,
its `ceilings` object: `python -m gpn_scale.bench.gpu` measures them) wins over the
defaults below, which come from this workplace's own measurements of the machine
(/work/.library/device/KINDS.md, quoted with their date) or from public figures, each
named. `gpu_model` prints every figure with its source, so a prediction says what it
rests on.

Torch-free: `gpn-scale sweep plan` prices sweeps with these.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpn_scale.accounting import device_runs
from gpn_scale.ops.gpn_step.options import PROJECTIONS

# cuBLAS on the step's GEMMs (64-128 rows against a 12-136 MB weight): an estimate, 70% of
# the copy bandwidth, below what the accounting prices the Triton GEMMs at (72-96%) and in
# the range public few-row bf16 GEMM measurements on H100s report; not measured here.
_CUBLAS_STEP_SHARE = 0.70
_CUBLAS_STEP_SOURCE = "est. (few-row bf16 GEMMs); the device check measures it (ceilings.gemms)"


@dataclass(frozen=True)
class Ceilings:
    """The rates and latencies of one GPU the accounting prices kernels with."""

    name: str
    sm_count: int
    copy_bytes_per_s: float  # HBM, a large device-to-device copy (bytes read + written)
    l2_bytes_per_s: float  # L2 -> SMs, every SM reading an L2-resident buffer
    l2_one_sm_bytes_per_s: float  # what one SM alone draws from L2
    latency_s: float  # one dependent global round trip under load (the latency model's unit)
    matmul_flops_per_s: float  # a large bf16 GEMM through cuBLAS (random data)
    datasheet_hbm_bytes_per_s: float
    datasheet_bf16_flops_per_s: float
    l2_bytes: int
    # Instruction issue: 4 schedulers per SM, each issuing one warp-instruction per clock at
    # most, and a warp's next dependent instruction no sooner than the arithmetic latency
    # (4 cycles on V100, A100 and H100: Jia et al., "Dissecting the NVIDIA Volta GPU
    # Architecture via Microbenchmarking" (2018); Ultrasonics Sonochemistry 99:106546 (2023),
    # Table 3), at the clock under load (KINDS.md read 1,980 MHz on the H200)
    sm_clock_hz: float = 1.98e9
    schedulers_per_sm: int = 4
    dependent_issue_cycles: int = 4
    # The share of the copy bandwidth cuBLAS reaches on a step's few-row GEMMs (bytes of A,
    # W and the output over its time; engine.cublas_gemms): measured by the device check at
    # the step's shapes (bench/gpu_ceilings.py `gemms`); until then an estimate.
    cublas_step_share: float = _CUBLAS_STEP_SHARE
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def source(self, key: str) -> str:
        return self.sources.get(key, "default")


# This workplace's H200 (KINDS.md, 2026-11-04, Firecracker and gVisor machines alike): a
# device-to-device copy through PyTorch ~4.3 TB/s counting bytes read and written; an
# 8192^3 bf16 product 769-798 TFLOP/s on random data; PyTorch reports 132 SMs, 60 MB L2.
_KINDS = "this workplace's H200, /work/.library/device/KINDS.md (2026-11-04)"
# L2 -> SM: 5,120 bytes per clock (NVIDIA's A100 whitepaper; the same width is listed for
# the H100 at 1,755 MHz, 8.99 TB/s, e.g. Ultrasonics Sonochemistry 99:106546 (2023), Table 3),
# at the H100/H200 SXM boost clock of 1,980 MHz (KINDS.md read 1,980 MHz under load): 10.1 TB/s
# nominal, taken at the share of nominal the copy reaches (4.3 / 4.8).
_L2_NOMINAL = 5120 * 1.98e9
_COPY_SHARE = 4.3e12 / 4.8e12
# One SM: an estimate, 64 bytes per clock from L2 at 1,980 MHz (127 GB/s); the device check
# measures it (one program reading an L2-resident buffer).
_L2_ONE_SM = 64 * 1.98e9
# A dependent global load under load: HBM3's idle latency is ~600-800 ns (gpu-engine spec;
# ~400-600 cycles in microbenchmarks of Hopper), and it rises under load: 1 us, the figure
# the project's Little's-law terms have used since the first accounting.
_LATENCY = 1.0e-6

DEFAULTS: dict[str, Ceilings] = {
    "h200": Ceilings(
        "H200",
        132,
        copy_bytes_per_s=4.3e12,
        l2_bytes_per_s=_L2_NOMINAL * _COPY_SHARE,
        l2_one_sm_bytes_per_s=_L2_ONE_SM,
        latency_s=_LATENCY,
        matmul_flops_per_s=785e12,
        datasheet_hbm_bytes_per_s=4.8e12,
        datasheet_bf16_flops_per_s=989e12,
        l2_bytes=60 * 2**20,
        sources={
            "copy_bytes_per_s": _KINDS,
            "matmul_flops_per_s": _KINDS + ", 8192^3 bf16, random data (769-798)",
            "l2_bytes_per_s": "5,120 B/clk (A100/H100 L2 read width) x 1.98 GHz x the copy's "
            "share of its datasheet (0.90)",
            "l2_one_sm_bytes_per_s": "est. 64 B/clk per SM x 1.98 GHz",
            "latency_s": "HBM latency under load (~0.6-0.8 us idle; gpu-engine spec)",
            "l2_bytes": _KINDS,
            "cublas_step_share": _CUBLAS_STEP_SOURCE,
        },
    ),
    "h100": Ceilings(
        "H100 SXM",
        132,
        # The H200's measured share of its datasheet (4.3 / 4.8) applied to the H100's
        # 3.35 TB/s; the same chip and clocks otherwise.
        copy_bytes_per_s=3.35e12 * _COPY_SHARE,
        l2_bytes_per_s=_L2_NOMINAL * _COPY_SHARE,
        l2_one_sm_bytes_per_s=_L2_ONE_SM,
        latency_s=_LATENCY,
        matmul_flops_per_s=785e12,
        datasheet_hbm_bytes_per_s=3.35e12,
        datasheet_bf16_flops_per_s=989e12,
        l2_bytes=50 * 2**20,
        sources={
            "copy_bytes_per_s": "H100 datasheet 3.35 TB/s x the H200's measured copy share 0.90",
            "matmul_flops_per_s": "the H200's measured bf16 GEMM (same SMs and clocks)",
            "l2_bytes_per_s": "as the H200 (same die and clocks)",
            "l2_one_sm_bytes_per_s": "est. 64 B/clk per SM x 1.98 GHz",
            "latency_s": "HBM latency under load (~0.6-0.8 us idle; gpu-engine spec)",
            "l2_bytes": "H100 SXM datasheet",
            "cublas_step_share": _CUBLAS_STEP_SOURCE,
        },
    ),
}

# results.json `ceilings` keys -> Ceilings fields (what bench/gpu.py writes)
MEASURED_KEYS = (
    "copy_bytes_per_s",
    "l2_bytes_per_s",
    "l2_one_sm_bytes_per_s",
    "latency_s",
    "matmul_flops_per_s",
)


def gpu_key(device_name: str) -> str | None:
    """'NVIDIA H200' -> 'h200'; 'NVIDIA H100 80GB HBM3' -> 'h100'; else None."""
    words = device_name.upper().replace("-", " ").split()
    for key in ("H200", "H100"):
        if key in words:
            return key.lower()
    return None


def for_gpu(gpu: str, runs_dir: Path | None = None) -> Ceilings:
    """The ceilings of `gpu` ('h200', 'h100'): the defaults, with each figure the newest
    committed device run on that GPU measured in its place (its source says which run)."""
    out = DEFAULTS[gpu]
    for run in device_runs.device_runs(runs_dir):
        try:
            blob = device_runs.read_results(run)
        except (OSError, ValueError):
            continue
        if gpu_key(blob.get("meta", {}).get("device_name", "")) == gpu:
            out = with_measured(out, blob.get("ceilings") or {}, f"measured, {run.name}")
    return out


def with_measured(base: Ceilings, measured: dict[str, Any], source: str) -> Ceilings:
    """`base` with each figure of MEASURED_KEYS that `measured` holds (a positive number:
    an error row has none) in its place, its source `source`."""
    changes: dict[str, Any] = {}
    sources = dict(base.sources)
    for key in MEASURED_KEYS:
        value = measured.get(key)
        if isinstance(value, (int, float)) and value > 0:
            changes[key] = float(value)
            sources[key] = source
    share = cublas_step_share(measured.get("gemms"), changes.get("copy_bytes_per_s"))
    if share is not None:
        changes["cublas_step_share"] = share
        sources["cublas_step_share"] = f"{source}, the median of cuBLAS at the step's GEMMs"
    return dataclasses.replace(base, **changes, sources=sources)


def cublas_step_share(gemms: Any, copy_bytes_per_s: float | None) -> float | None:
    """The median share of the copy bandwidth cuBLAS drew at the step's GEMMs (a device
    run's `ceilings.gemms` rows of the projections `engine.cublas_gemms` names, against its
    own measured copy); None where the run has neither."""
    if not isinstance(gemms, list) or not copy_bytes_per_s:
        return None
    shares = [
        g["gbytes_per_s"] * 1e9 / copy_bytes_per_s
        for g in gemms
        if isinstance(g, dict)
        and g.get("role") in PROJECTIONS
        and isinstance(g.get("gbytes_per_s"), (int, float))
        and g["gbytes_per_s"] > 0
    ]
    return statistics.median(shares) if shares else None


def describe(c: Ceilings) -> list[str]:
    """One line per figure with its source (for the accounting's report)."""
    rows = [
        ("copy_bytes_per_s", f"HBM copy {c.copy_bytes_per_s / 1e12:.2f} TB/s"),
        ("l2_bytes_per_s", f"L2 -> SMs {c.l2_bytes_per_s / 1e12:.2f} TB/s"),
        ("l2_one_sm_bytes_per_s", f"L2 -> one SM {c.l2_one_sm_bytes_per_s / 1e9:.0f} GB/s"),
        ("latency_s", f"dependent round trip {c.latency_s * 1e6:.2f} us"),
        ("matmul_flops_per_s", f"bf16 GEMM {c.matmul_flops_per_s / 1e12:.0f} TFLOP/s"),
        ("cublas_step_share", f"cuBLAS at the step GEMMs {c.cublas_step_share:.0%} of the copy"),
    ]
    return [f"{text} ({c.source(key)})" for key, text in rows]
