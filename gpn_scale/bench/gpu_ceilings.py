"""The ceilings the launch accounting prices with (`accounting/ceilings.py`, its
`MEASURED_KEYS`), measured on the device in one short call (estimated ~10 s of an H200 with
the kernels' compiles; not yet timed there):

    python -m gpn_scale.bench.gpu_ceilings --out "$OUT"                         # on the GPU
    python -m gpn_scale.bench.gpu_ceilings --out /tmp/c --device cpu --scale tiny  # smoke test

- `copy_bytes_per_s`: a 2 GiB device-to-device copy, bytes read + written (as KINDS.md counts).
- `l2_bytes_per_s`: every SM reading an ~8 MiB L2-resident buffer (8 programs per SM, each
  summing another slice on every repeat); `l2_one_sm_bytes_per_s`: one program over 1 MiB.
- `latency_s`: one dependent global load (a pointer chase: one program, one load at a time,
  each address the previous load's value, through a random single cycle with slots 128 bytes
  apart): `latency_hbm_idle_s` over 512 MiB (several times the L2), `latency_l2_s` over 4 MiB,
  `latency_hbm_loaded_s` over the 512 MiB while copies keep HBM busy from another stream.
  `latency_s` is the loaded figure because that is the situation the accounting prices: a
  kernel's dependent round trips happen while its own other programs (or the GEMM's weight
  stream) keep the memory busy, and its Little's-law terms (bytes in flight = bandwidth x
  latency) ask for the latency AT full bandwidth; the idle figure would understate both.
  The 512 MiB chase also pays TLB misses that a streaming kernel mostly does not, so the HBM
  figures are on the high side of a plain HBM round trip.
- `matmul_flops_per_s`: bf16 8192^3 through torch.matmul (cuBLAS) on random data; `gemms`:
  the GPN+M 130M step's skinny GEMMs at B = 64 and 128 and the chunk-wide input GEMM, each
  rotating among enough weight copies that the weights come from HBM as in a step.

Also returned: `latency_hbm_loaded_overlapped` (the copies ran all through every loaded
chase; None on CPU), `sm_count`, `l2_bytes`, `device_name`, `scale`, `sizes` and `spread`
((max - min) / median of each figure's repetitions). Compiled for sm_90 here (Triton 3.8,
ptxas -v, cuobjdump): the L2 reads are LDG.E.128.STRONG.GPU (`.cg`, no spills; 100 registers
for the one-SM variant), the chase one LDG per step, each on the last one's value.

Every figure is the median of several repetitions timed with CUDA events after warm-up (on
CPU: the wall clock), on random data (never zeros; METHOD.md). `scale="tiny"` runs every
code path on tiny sizes in seconds on CPU, the Triton kernels under TRITON_INTERPRET=1: its
numbers mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import triton
import triton.language as tl

SCALES = ("full", "tiny")
EXIT_BAD_INPUT = 2


@dataclass(frozen=True)
class StepDims:
    """The GEMM dimensions of one GPN+M step (defaults: the 130M 1-layer config)."""

    d: int = 2496  # model width
    width: int = 27358  # the input projection's output columns
    hidden: int = 10496  # the FFN's hidden width (the down projection's K)
    batches: tuple[int, ...] = (64, 128)
    chunk: int = 64  # time steps per chunk: the chunk-wide GEMM has chunk x B rows
    chunk_batch: int = 64


@dataclass(frozen=True)
class Sizes:
    copy_bytes: int  # the copied buffer (moved: twice this)
    l2_buffer_bytes: int  # read by every SM; well inside the L2 (H200: 60 MB)
    l2_programs_per_sm: int
    l2_block: int  # float32 elements per load step
    l2_warps: int
    l2_repeats: int
    one_sm_bytes: int  # one program's buffer: over the SM's L1 (256 KB), inside the L2
    one_sm_block: int
    one_sm_warps: int
    one_sm_repeats: int
    chase_hbm_bytes: int
    chase_l2_bytes: int
    chase_stride_bytes: int  # one slot per 128-byte line: no two slots share a line
    chase_steps: int
    matmul_n: int
    step: StepDims
    reps: int
    warmup: int


SIZES = {
    "full": Sizes(
        copy_bytes=2 << 30,
        l2_buffer_bytes=8 << 20,
        l2_programs_per_sm=8,
        l2_block=1024,
        l2_warps=4,
        l2_repeats=256,  # ~2 GB read per launch: ~0.2 ms at 10 TB/s, well past launch cost
        one_sm_bytes=1 << 20,
        # 16 warps x 32 floats a thread, and the next block prefetched: 128 KB in flight, over
        # the 64 KB that 64 B/clock x a ~0.5 us L2 round trip needs (ptxas, sm_90: 100
        # registers, no spills)
        one_sm_block=16384,
        one_sm_warps=16,
        one_sm_repeats=64,
        chase_hbm_bytes=512 << 20,
        chase_l2_bytes=4 << 20,
        chase_stride_bytes=128,
        chase_steps=10_000,  # ~10 ms at ~1 us a trip
        matmul_n=8192,
        step=StepDims(),
        reps=10,
        warmup=3,
    ),
    "tiny": Sizes(
        copy_bytes=1 << 20,
        l2_buffer_bytes=64 << 10,
        l2_programs_per_sm=2,
        l2_block=256,
        l2_warps=4,
        l2_repeats=2,
        one_sm_bytes=16 << 10,
        one_sm_block=1024,
        one_sm_warps=4,
        one_sm_repeats=2,
        chase_hbm_bytes=64 << 10,
        chase_l2_bytes=16 << 10,
        chase_stride_bytes=128,
        chase_steps=64,
        matmul_n=64,
        step=StepDims(d=32, width=96, hidden=64, batches=(2, 4), chunk=4, chunk_batch=2),
        reps=3,
        warmup=1,
    ),
}
CPU_SM_COUNT = 2  # the program grid's stand-in for the SM count where there are no SMs


# --------------------------------------------------------------------------- kernels
@functools.cache
def _kernels(interpret: bool) -> SimpleNamespace:
    """The Triton kernels, built on first use so that TRITON_INTERPRET is read then (triton.jit
    decides compiled or interpreted when it decorates); one set per mode. They name only
    module globals (`tl`), no closure variables, which older Triton's compiler cannot see."""
    del interpret  # the cache key: the environment it was built under

    @triton.jit
    def l2_read_kernel(X, OUT, PROGRAMS, SLICE, REPEATS, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in range(REPEATS):
            # Another slice every repeat (each read once per repeat over the grid): nothing
            # for the compiler to hoist, and no program re-reads what it just read. `.cg`
            # caches in L2 only, so the L1 cannot flatter the figure.
            base = X + ((pid + r) % PROGRAMS).to(tl.int64) * SLICE
            x = tl.load(base + offs, cache_modifier=".cg")
            for j in range(BLOCK, SLICE, BLOCK):
                nxt = tl.load(base + j + offs, cache_modifier=".cg")  # next block in flight
                acc += x
                x = nxt
            acc += x
        tl.store(OUT + pid, tl.sum(acc, axis=0))

    @triton.jit
    def chase_kernel(P, CURSOR, STEPS):
        # One load at a time: each address is the previous load's value.
        idx = tl.load(CURSOR)
        for _ in range(STEPS):
            idx = tl.load(P + idx, cache_modifier=".cg")
        tl.store(CURSOR, idx)  # the next repetition goes on along the cycle from here

    return SimpleNamespace(l2_read=l2_read_kernel, chase=chase_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def l2_read_sum(x: torch.Tensor, programs: int, repeats: int, block: int, warps: int = 4) -> Any:
    """Launch the L2-read kernel over float32 `x` (programs x slice elements, slice a
    multiple of `block`); returns the per-program sums (together: sum(x) x repeats)."""
    if x.numel() % programs or (x.numel() // programs) % block:
        raise ValueError(f"{x.numel()} elements do not split into {programs} x k x {block}")
    out = torch.empty(programs, dtype=torch.float32, device=x.device)
    _kernels(_interpreting()).l2_read[(programs,)](
        x, out, programs, x.numel() // programs, repeats, BLOCK=block, num_warps=warps
    )
    return out


def chase(buffer: torch.Tensor, cursor: torch.Tensor, steps: int) -> None:
    """`steps` dependent loads along `buffer` (from `chase_buffer`) from `cursor`, which is
    left at the slot reached."""
    _kernels(_interpreting()).chase[(1,)](buffer, cursor, steps, num_warps=1)


# --------------------------------------------------------------------------- pure helpers
def cyclic_permutation(n: int, generator: torch.Generator) -> torch.Tensor:
    """`nxt` with nxt[i] the slot after i on ONE random cycle through all n slots (a random
    permutation could split into short cycles a chase would spin in, inside the cache)."""
    order = torch.randperm(n, generator=generator)
    nxt = torch.empty(n, dtype=torch.int64)
    nxt[order] = order.roll(-1)
    return nxt


def chase_buffer(
    nxt: torch.Tensor, stride: int, device: torch.device | None = None
) -> torch.Tensor:
    """int32 buffer with slot i at element i*stride holding the next slot's element offset;
    the elements between slots are never read (-1)."""
    if len(nxt) * stride >= 2**31:
        raise ValueError(f"{len(nxt)} slots x stride {stride} overflow int32 offsets")
    buf = torch.full((len(nxt) * stride,), -1, dtype=torch.int32, device=device)
    buf[::stride] = (nxt * stride).to(torch.int32).to(buf.device)
    return buf


def step_gemms(dims: StepDims = StepDims()) -> list[tuple[str, int, int, int, bool]]:
    """(role, M, K, N, weight transposed) of the step's GEMMs at each batch, each role the
    projection `engine.cublas_gemms` names (ops/gpn_step/options.PROJECTIONS), then the
    chunk-wide one. The backward's dx products use the forward weight transposed, as the
    engine does."""
    d, w, h = dims.d, dims.width, dims.hidden
    rows: list[tuple[str, int, int, int, bool]] = []
    for b in dims.batches:
        rows += [
            ("input", b, d, w, False),
            ("input_dx", b, w, d, True),
            ("down", b, h, d, False),
            ("down_dx", b, d, h, True),
            ("fuse_gate", b, d, d, False),
            ("fuse_gate_dx", b, d, d, True),
        ]
    rows.append(("chunk-wide input", dims.chunk * dims.chunk_batch, d, w, False))
    return rows


# --------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_reps(
    fn: Callable[[int], object],
    device: torch.device,
    reps: int,
    warmup: int,
) -> list[float]:
    """Seconds of each of `reps` calls fn(i) after `warmup` untimed ones (CUDA events around
    each call; on CPU the wall clock)."""
    for i in range(warmup):
        fn(i)
    _sync(device)
    if device.type != "cuda":
        out = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(i)
            out.append(time.perf_counter() - t0)
        return out
    # ~1 ms of GPU spin first: the host queues the repetitions while it runs, so no start
    # event fires on an idle GPU waiting for the host's next launch
    torch.cuda._sleep(2_000_000)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for i, (start, end) in enumerate(events):
        start.record()
        fn(i)
        end.record()
    _sync(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def _median(samples: list[float], spread: dict[str, float], key: str) -> float:
    """The median, with the samples' (max - min) / median kept under `key`."""
    m = statistics.median(samples)
    spread[key] = (max(samples) - min(samples)) / m if m > 0 else math.inf
    return m


# --------------------------------------------------------------------------- measurements
def _copy(device: torch.device, s: Sizes, spread: dict) -> tuple[float, tuple]:
    src = torch.randn(s.copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    secs = _median(time_reps(lambda _: dst.copy_(src), device, s.reps, s.warmup), spread, "copy")
    return 2 * s.copy_bytes / secs, (src, dst, secs)


def _l2_read(
    device: torch.device,
    s: Sizes,
    programs: int,
    target_bytes: int,
    block: int,
    warps: int,
    repeats: int,
) -> tuple[list[float], int]:
    """Timed launches of `programs` programs reading ~target_bytes `repeats` times, and the
    bytes one launch reads."""
    slice_ = max(1, round(target_bytes / 4 / programs / block)) * block
    x = torch.randn(programs * slice_, device=device)
    samples = time_reps(
        lambda _: l2_read_sum(x, programs, repeats, block, warps), device, s.reps, s.warmup
    )
    return samples, x.numel() * 4 * repeats


def _chase_setup(device: torch.device, nbytes: int, stride_bytes: int, seed: int):
    stride = stride_bytes // 4
    nxt = cyclic_permutation(max(2, nbytes // stride_bytes), torch.Generator().manual_seed(seed))
    buf = chase_buffer(nxt, stride, device)
    return buf, torch.zeros(1, dtype=torch.int32, device=device)


def _latencies(device: torch.device, s: Sizes, load: tuple, spread: dict) -> dict[str, Any]:
    steps = s.chase_steps
    hbm, hbm_cursor = _chase_setup(device, s.chase_hbm_bytes, s.chase_stride_bytes, 1)
    l2, l2_cursor = _chase_setup(device, s.chase_l2_bytes, s.chase_stride_bytes, 2)
    reps = max(3, s.reps // 2)
    # The HBM chase goes on along its cycle (4M slots) from rep to rep: no slot comes round
    # again, so none is still in the L2.
    idle = _median(
        time_reps(lambda _: chase(hbm, hbm_cursor, steps), device, reps, s.warmup),
        spread,
        "latency_hbm_idle",
    )
    # Read the whole 4 MiB once before timing: every slot is then an L2 hit.
    l2.sum()
    l2_s = _median(
        time_reps(lambda _: chase(l2, l2_cursor, steps), device, reps, s.warmup),
        spread,
        "latency_l2",
    )
    out: dict[str, Any] = {
        "latency_hbm_idle_s": idle / steps,
        "latency_l2_s": l2_s / steps,
    }
    if device.type != "cuda":
        out["latency_hbm_loaded_s"] = out["latency_hbm_idle_s"]
        out["latency_hbm_loaded_overlapped"] = None
        return out
    src, dst, copy_s = load
    loaded, covered = _loaded_chase(hbm, hbm_cursor, steps, src, dst, copy_s, idle, reps)
    out["latency_hbm_loaded_s"] = _median(loaded, spread, "latency_hbm_loaded") / steps
    out["latency_hbm_loaded_overlapped"] = covered  # the copies ran all through every chase
    return out


def _loaded_chase(
    buf, cursor, steps: int, src, dst, copy_s: float, idle_s: float, reps: int
) -> tuple[list[float], bool]:
    """The chase on a high-priority stream while copies run on another (the copies queued
    first, to cover ~4x the idle chase), and whether they covered it every time."""
    copies = math.ceil(4 * idle_s / copy_s) + 2
    low = torch.cuda.Stream(buf.device, priority=0)
    high = torch.cuda.Stream(buf.device, priority=-1)  # its program first when a slot frees
    samples, covered = [], True
    for i in range(reps + 1):  # the first is a warm-up
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        with torch.cuda.stream(low):
            ev[0].record()
            for _ in range(copies):
                dst.copy_(src)
            ev[3].record()
        with torch.cuda.stream(high):
            high.wait_event(ev[0])
            torch.cuda._sleep(100_000)  # ~50 us: the copies up to full speed first
            ev[1].record()
            chase(buf, cursor, steps)
            ev[2].record()
        torch.cuda.synchronize(buf.device)
        if i:
            samples.append(ev[1].elapsed_time(ev[2]) / 1e3)
            covered &= ev[0].elapsed_time(ev[2]) < ev[0].elapsed_time(ev[3])
    return samples, covered


def _matmul(device: torch.device, s: Sizes, spread: dict) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = s.matmul_n
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    c = torch.empty(n, n, device=device, dtype=dtype)
    secs = _median(
        time_reps(lambda _: torch.matmul(a, b, out=c), device, s.reps, s.warmup),
        spread,
        "matmul",
    )
    return 2 * n**3 / secs


def _gemms(device: torch.device, s: Sizes, l2_bytes: int | None) -> list[dict[str, Any]]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = dtype.itemsize
    rows = []
    for role, m, k, n, transposed in step_gemms(s.step):
        # Enough weight copies that the one timed was not read in the last ~2 L2s' worth
        copies = max(2, math.ceil(2 * (l2_bytes or 0) / (k * n * size)) + 1)
        shape = (n, k) if transposed else (k, n)
        weights = [torch.randn(shape, device=device, dtype=dtype) for _ in range(copies)]
        a = torch.randn(m, k, device=device, dtype=dtype)
        c = torch.empty(m, n, device=device, dtype=dtype)

        def run(i: int, a=a, c=c, weights=weights, transposed=transposed) -> None:
            w = weights[i % len(weights)]
            torch.matmul(a, w.t() if transposed else w, out=c)

        secs = statistics.median(time_reps(run, device, 2 * s.reps, s.warmup))
        rows.append(
            {
                "shape": [m, k, n],
                "role": role,
                "weight_transposed": transposed,
                "seconds": secs,
                "tflops": 2 * m * k * n / secs / 1e12,
                "gbytes_per_s": (m * k + k * n + m * n) * size / secs / 1e9,
            }
        )
        del weights, a, c
    return rows


def _spin_up(device: torch.device, s: Sizes) -> None:
    """~0.1 s of matrix products first: an idle H200 sat at 345 MHz (KINDS.md), and the first
    figure measured must not pay for the clock's climb."""
    a = torch.randn(s.matmul_n, s.matmul_n, device=device, dtype=torch.bfloat16)
    for _ in range(64):
        a @ a
    _sync(device)


def device_facts(device: torch.device) -> dict[str, Any]:
    """device_name, sm_count and l2_bytes (None where there are no SMs)."""
    if device.type != "cuda":
        import platform

        return {"device_name": platform.processor() or "cpu", "sm_count": None, "l2_bytes": None}
    props = torch.cuda.get_device_properties(device)
    return {
        "device_name": props.name,
        "sm_count": int(props.multi_processor_count),
        "l2_bytes": int(getattr(props, "L2_cache_size", 0)) or None,
    }


def measure_ceilings(device: torch.device, scale: str = "full") -> dict[str, Any]:
    """The accounting's measured ceilings (MEASURED_KEYS, SI units) and the figures behind
    them on `device`; see the module docstring for what each is."""
    if scale not in SIZES:
        raise ValueError(f"unknown scale {scale!r}: use one of {', '.join(SIZES)}")
    if device.type == "cpu" and not _interpreting():
        raise ValueError("on CPU the Triton kernels need TRITON_INTERPRET=1 in the environment")
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        return _measure(device, SIZES[scale], scale)


def _measure(device: torch.device, s: Sizes, scale: str) -> dict[str, Any]:
    facts = device_facts(device)
    programs_per_grid = (facts["sm_count"] or CPU_SM_COUNT) * s.l2_programs_per_sm
    spread: dict[str, float] = {}
    if device.type == "cuda":
        _spin_up(device, s)
    copy_rate, load = _copy(device, s, spread)
    samples, nbytes = _l2_read(
        device, s, programs_per_grid, s.l2_buffer_bytes, s.l2_block, s.l2_warps, s.l2_repeats
    )
    l2_rate = nbytes / _median(samples, spread, "l2")
    samples, nbytes = _l2_read(
        device, s, 1, s.one_sm_bytes, s.one_sm_block, s.one_sm_warps, s.one_sm_repeats
    )
    one_sm_rate = nbytes / _median(samples, spread, "l2_one_sm")
    latencies = _latencies(device, s, load, spread)
    del load
    result: dict[str, Any] = {
        "copy_bytes_per_s": copy_rate,
        "l2_bytes_per_s": l2_rate,
        "l2_one_sm_bytes_per_s": one_sm_rate,
        "latency_s": latencies["latency_hbm_loaded_s"],
        "matmul_flops_per_s": _matmul(device, s, spread),
        **latencies,
        "gemms": _gemms(device, s, facts["l2_bytes"]),
        **facts,
        "scale": scale,
        "spread": spread,  # (max - min) / median of each figure's repetitions
        "sizes": asdict(s),
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# --------------------------------------------------------------------------- CLI
_TABLE = (
    ("copy_bytes_per_s", 1e12, "TB/s", "HBM: a large device-to-device copy, read + written"),
    ("l2_bytes_per_s", 1e12, "TB/s", "L2 -> every SM, an L2-resident buffer"),
    ("l2_one_sm_bytes_per_s", 1e9, "GB/s", "L2 -> one SM (one program)"),
    ("latency_s", 1e-6, "us", "dependent load, HBM under a copy's load (the accounting's)"),
    ("latency_hbm_idle_s", 1e-6, "us", "dependent load, HBM, idle"),
    ("latency_l2_s", 1e-6, "us", "dependent load, L2 hit"),
    ("matmul_flops_per_s", 1e12, "TFLOP/s", "torch.matmul n^3 (8192, bf16 on full), random data"),
)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Ceilings of {result['device_name']} (scale {result['scale']}, SMs "
        f"{result['sm_count']}, L2 {result['l2_bytes']} bytes)",
        "",
        "| figure | value | unit | what |",
        "| --- | ---: | --- | --- |",
    ]
    for key, div, unit, what in _TABLE:
        lines.append(f"| {key} | {result[key] / div:.3g} | {unit} | {what} |")
    lines += [
        "",
        "| GEMM | M x K x N | us | TFLOP/s | GB/s |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for g in result["gemms"]:
        m, k, n = g["shape"]
        lines.append(
            f"| {g['role']} | {m} x {k} x {n} | {g['seconds'] * 1e6:.1f} | "
            f"{g['tflops']:.1f} | {g['gbytes_per_s']:.0f} |"
        )
    return "\n".join(lines)


def _bad_input(args: argparse.Namespace) -> str | None:
    if args.scale not in SIZES:
        return f"unknown --scale {args.scale!r}: use one of {', '.join(SIZES)}"
    if args.out.exists() and not args.out.is_dir():
        return f"--out {args.out} is a file: give a directory (it is created if missing)"
    try:
        kind = torch.device(args.device).type
    except RuntimeError:
        return f"unknown --device {args.device!r}: use cuda, cuda:N or cpu"
    if kind == "cpu" and args.scale == "full":
        return "--scale full on CPU would run for hours in Triton's interpreter: use --scale tiny"
    if kind == "cuda" and not torch.cuda.is_available():
        return "--device cuda but torch.cuda.is_available() is False: use --device cpu --scale tiny"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for ceilings.json")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--scale", default="full", help="full (default) or tiny")
    args = parser.parse_args(argv)
    problem = _bad_input(args)
    if problem:
        print(f"gpu_ceilings: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    device = torch.device(args.device)
    if device.type == "cpu":
        # Before the kernels are built (on first use, below)
        os.environ["TRITON_INTERPRET"] = "1"
        from gpn_scale.ops.triton_interpreter import prepare_interpreter

        prepare_interpreter()
    result = measure_ceilings(device, args.scale)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ceilings.json").write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
