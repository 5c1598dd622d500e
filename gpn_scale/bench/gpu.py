"""The device check: one script for a session that is lent a GPU (results under --out).

    python -m gpn_scale.bench.gpu --out "$OUT"              # on the GPU machine (<= 8 min)
    python -m gpn_scale.bench.gpu --device cpu --config tiny,tiny_2l --seq-len 32 \\
        --batches 2,4 --steps 1 --warmup 0 --out /tmp/gpu-smoke   # the same code, as a smoke test

0. CUDA usable? With --device cuda and no usable CUDA it stops at once with one line
   (torch's CUDA version and the driver's), before anything else.
1. Exactness on the device: the engine against the step-by-step reference on a tiny
   2-layer config (loss and every gradient) in float64, and in float32 with and without
   CUDA graphs (where the engine has the `cuda_graphs` option); one bf16-autocast step
   (finite loss; state and memory stay float32). Gated DeltaNet's fla kernels against our
   chunkwise op (loss, every gradient, a carried-state continuation; float32): fla cannot
   run on CPU, so this is its first check (skipped, and said so, without CUDA or fla).
2. Throughput: each `--config` (default the paper's 130M 1-layer and 2-layer GPN+M) and a
   Transformer++ with the first config's parameter count (the family's model,
   gpn_scale/models/transformer_pp, sized by counts.matching_config),
   at `--seq-len` (2048), bf16 autocast, AdamW, batch sizes doubling from `--min-batch` up
   to the first that does not fit (or an explicit `--batches` list). Per batch: tokens/s,
   MFU (against the device's dense bf16 peak), peak memory allocated and reserved, and from
   one torch.profiler step: kernels per training step and per time step, host launch calls,
   and the fraction of the step's wall time the GPU is busy. Then the ratio of GPN+M to
   Transformer++ tokens/s, each at its best batch.
3. Before anything runs on the GPU, every Triton kernel variant the GPN runs will launch
   (the exactness configs, each `--config` at batches 8 to 512) is compiled into
   `--triton-cache` (default .cache/triton-device) by `accounting/gpu_compile.py`, one process per
   CPU core, and this process's Triton cache is pointed there: a first use that compiled
   serially (~68 s at 130M, most of it the memory kernels) then finds them built. Variants
   already in the directory (carried from an earlier run) are cache hits. Best effort: a
   failure is recorded and the kernels compile on first use as before.
4. `--max-seconds` (default 450) bounds the whole run: each model gets an equal share of
   what is left when it starts, and a batch is not started when twice the previous one's
   cost would overrun that share.

results.json and results.md are rewritten after every step, so a run cut short leaves
what it measured. Nothing is asserted here; the exactness tolerances are those of
tests/models/gpn/test_engine.py and the verdict is printed next to each error.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpn_scale.core.hardware import device_peak_flops
from gpn_scale.models.gpn import GPN, GPNConfig, load_model_config
from gpn_scale.models.gpn.counts import count_parameters, flops_per_token
from gpn_scale.models.gpn.reference import reference_forward
from gpn_scale.ops.gpn_step.registry import clear_cuda_graphs, cuda_graphs_status
from gpn_scale.testing.models import perturbed_model, tiny_config

TINY = tiny_config(n_layers=2)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
# The GPN's launch count is measured on a window this long: at today's ~450 kernels per time
# step a full 2048-step window is ~1M kernel records, more than the profiler's activity
# buffers hold. Kernels per time step do not depend on T (chunk work recurs every chunk);
# the window-level work (embedding, decode, optimizer) is then spread over fewer steps.
PROFILE_SEQ_LEN = 256
EXIT_NO_CUDA = 2


def _clock() -> float:
    """The budget's clock (a seam for tests)."""
    return time.perf_counter()


# --------------------------------------------------------------------------- 0. CUDA usable
def driver_version() -> str:
    """The NVIDIA driver's version (nvidia-smi), else the CUDA driver API's, else 'unknown'."""
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=15,
                check=False,
            ).stdout.split()
            if out:
                return out[0]
    with contextlib.suppress(Exception):
        v = int(torch._C._cuda_getDriverVersion())  # type: ignore[attr-defined]
        if v > 0:
            return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    return "unknown"


def cuda_problem() -> str | None:
    """Why CUDA cannot be used here (one line), or None when a tiny kernel runs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if not available:
        said = next((str(w.message).splitlines()[0] for w in caught), "")
        return "torch.cuda.is_available() is False" + (f": {said}" if said else "")
    try:
        (torch.ones(1, device="cuda") + 1).item()
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable", said in one line
        return f"a first kernel failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    return None


# --------------------------------------------------------------------------- results file
class Results:
    """meta, checks, runs, summary; both files rewritten (atomically) after every step."""

    def __init__(self, out: Path, meta: dict) -> None:
        self.out, self.meta = out, meta
        self.checks: list[dict] = []
        self.runs: list[dict] = []
        self.summary: dict[str, Any] = {}

    def save(self) -> None:
        self.meta["elapsed_s"] = round(_clock() - self.meta["_t0"], 1)
        blob = dict(
            meta={k: v for k, v in self.meta.items() if not k.startswith("_")},
            checks=self.checks,
            runs=self.runs,
            summary=self.summary,
        )
        for name, text in (
            ("results.json", json.dumps(blob, indent=2)),
            ("results.md", markdown(blob)),
        ):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out / name)


# --------------------------------------------------------------------------- 1. exactness
PREBUILD_BATCHES = (8, 16, 32, 64, 128, 256, 512)


def default_triton_cache() -> Path:
    return Path(__file__).resolve().parents[2] / ".cache" / "triton-device"


def prebuild_triton_cache(
    cache_dir: Path, configs: list[str], seq_len: int, arch: str, log: Path, timeout_s: float
) -> dict:
    """Compile the check's kernel variants into `cache_dir` (a Triton cache) in parallel
    processes (accounting/gpu_compile.py --triton-cache); what it did, for results.json."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    batches = ",".join(map(str, PREBUILD_BATCHES))
    runs = [
        ["testing_tiny", "--set", "n_layers=2", "--dtype", "fp64", "--batch", "3"],
        ["testing_tiny", "--set", "n_layers=2", "--dtype", "fp32", "--batch", "3"],
        [*configs, "--batch", batches, "--seq-len", str(seq_len)],
    ]
    t0 = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with open(log, "w") as out:
        for extra in runs:
            cmd = [sys.executable, "-m", "gpn_scale.accounting.gpu_compile", *extra, "--arch", arch]
            cmd += ["--triton-cache", str(cache_dir), "--jobs", str(os.cpu_count() or 1)]
            left = timeout_s - (time.perf_counter() - t0)
            try:
                done = subprocess.run(
                    cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=max(1, left)
                )
            except subprocess.TimeoutExpired:
                return dict(ok=False, dir=str(cache_dir), error=f"timed out after {timeout_s} s")
            if done.returncode != 0:
                return dict(ok=False, dir=str(cache_dir), error=f"exit {done.returncode}: {log}")
    entries = sum(1 for _ in cache_dir.iterdir())
    return dict(ok=True, dir=str(cache_dir), entries=entries, seconds=time.perf_counter() - t0)


def use_triton_cache(cache_dir: Path) -> None:
    """Point this process's Triton JIT at `cache_dir` (before its first compile)."""
    os.environ["TRITON_CACHE_DIR"] = str(cache_dir)
    with contextlib.suppress(ImportError, AttributeError):
        import triton

        triton.knobs.cache.dir = str(cache_dir)


def graph_settings() -> list[bool | None]:
    """The CUDA backend with and without graph capture (`engine.cuda_graphs`)."""
    return [True, False]


def error_line(exc: BaseException) -> str:
    """An exception as one line for results.json (its type and first line)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def guarded(name: str, check: Callable[..., dict], *args: Any) -> dict:
    """`check(*args)`'s row, or a failed row naming the exception: the other checks and the
    throughput still run (device time is scarce; the traceback goes to the log)."""
    try:
        return check(*args)
    except Exception as exc:  # noqa: BLE001 - recorded as a failed check
        traceback.print_exc()
        return dict(check=name, error=error_line(exc), ok=False)


def check_exactness(device: torch.device) -> Iterator[dict]:
    tokens = torch.randint(0, TINY.vocab_size, (3, 12), generator=torch.Generator().manual_seed(3))
    tokens = tokens.to(device)
    cases = [(torch.float64, None)] + [(torch.float32, g) for g in graph_settings()]
    for dtype, graphs in cases:
        name = f"engine == reference, {str(dtype).replace('torch.', '')}"
        if graphs is not None:
            name += ", CUDA graphs " + ("on" if graphs else "off")
        yield guarded(name, _engine_against_reference, device, tokens, dtype, graphs, name)
    yield guarded("bf16 autocast step", _bf16_autocast_step, device, tokens)


def _engine_against_reference(
    device: torch.device,
    tokens: torch.Tensor,
    dtype: torch.dtype,
    graphs: bool | None,
    name: str,
) -> dict:
    """The engine's loss and every gradient against the step-by-step reference."""
    cfg = TINY if graphs is None else TINY.replace(cuda_graphs=graphs)
    model = perturbed_model(cfg, dtype).to(device)
    params = list(model.parameters())
    out = model(tokens)
    ref = reference_forward(model, tokens)
    g_out = torch.autograd.grad(out.loss, params)
    g_ref = torch.autograd.grad(ref.loss, params)
    loss_err = ((out.loss - ref.loss).abs() / ref.loss.abs()).item()
    grad_err = max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(g_out, g_ref)
    )
    tol = TOLERANCE[dtype]
    return dict(
        check=name,
        loss_rel_err=loss_err,
        grad_rel_err=grad_err,
        tolerance=tol,
        ok=loss_err <= tol and grad_err <= tol,
    )


def _bf16_autocast_step(device: torch.device, tokens: torch.Tensor) -> dict:
    """One bf16-autocast step: a finite loss and gradients; state and memory stay fp32."""
    model = perturbed_model(TINY, torch.float32).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(tokens, return_state=True)
    out.loss.backward()
    finite = bool(torch.isfinite(out.loss)) and all(
        bool(torch.isfinite(p.grad).all()) for p in model.parameters()
    )
    fp32 = out.state.s.dtype == torch.float32 and out.state.memory.dtype == torch.float32
    return dict(
        check="bf16 autocast step",
        loss=out.loss.item(),
        finite=finite,
        state_and_memory_fp32=fp32,
        ok=finite and fp32,
    )


GDN_TINY = dict(
    family="gated_deltanet",
    vocab_size=64,
    d_model=64,
    n_layers=2,
    n_heads=2,
    d_key=32,
    d_value=32,
    d_ffn=96,
    chunk_size=16,
)


def check_gated_deltanet_fla(device: torch.device) -> Iterator[dict]:
    """Gated DeltaNet's fla kernels (its CUDA path) against our chunkwise op (held to fla's
    reference forms and to a step-by-step recurrence in the CPU tests), float32. CPU runs
    cannot load fla's kernels: recorded as skipped, with the reason."""
    from gpn_scale.ops.gated_delta_rule import fla_import_error

    name = "GDN fla == chunk, float32"
    why = "needs CUDA" if device.type != "cuda" else fla_import_error()
    if why is not None:
        yield dict(check=name, skipped=why, ok=True)
        return
    # fla's kernels accumulate in their own order (and may use TF32 dots)
    yield guarded(name, _compare_gdn_row, device, name)


def _compare_gdn_row(device: torch.device, name: str) -> dict:
    try:
        return dict(check=name, **compare_gdn_backends(device, "chunk", "fla", tolerance=5e-3))
    except RuntimeError as exc:
        # fla refuses Triton builds it knows to be wrong on this GPU (3.4 to 3.7.0 on Hopper:
        # the H200 image's 3.6); not a fault of ours, and nothing to compare
        if "upgrade Triton" not in str(exc):
            raise
        return dict(check=name, skipped=f"fla refuses this Triton: {error_line(exc)}", ok=True)


def compare_gdn_backends(
    device: torch.device, reference: str, other: str, tolerance: float
) -> dict[str, Any]:
    """The same tiny Gated DeltaNet (float32) on two gated-delta-rule backends: relative
    errors of the loss, of every gradient, and of a continuation from a carried state (fla
    decodes it with its fused recurrent kernel)."""
    from gpn_scale.models.registry import config_from_dict

    spec, cfg = config_from_dict(GDN_TINY)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=gen).to(device)
    results = {}
    for backend in (reference, other):
        torch.manual_seed(0)
        model = spec.build(cfg.replace(backend=backend)).to(device)
        out = model(tokens)
        grads = torch.autograd.grad(out.loss, list(model.parameters()))
        with torch.no_grad():
            state = model(tokens[:, :31], return_state=True).state
            cont = model(tokens[:, 31:], state, return_logits=True).logits
        results[backend] = (out.loss.detach(), grads, cont)
    (l0, g0, c0), (l1, g1, c1) = results[reference], results[other]
    errors = dict(
        loss_rel_err=((l1 - l0).abs() / l0.abs()).item(),
        grad_rel_err=max(
            ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(g1, g0)
        ),
        continuation_rel_err=((c1 - c0).abs().max() / c0.abs().max()).item(),
    )
    return dict(**errors, tolerance=tolerance, ok=max(errors.values()) <= tolerance)


# --------------------------------------------------------------------------- 2. profiler
# Host calls that put work on the GPU one launch at a time (runtime and driver API; Triton
# launches through the driver), and the graph launches that replay many kernels at once.
_LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cudaLaunchCooperativeKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel",
)
_GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
_DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
_TOP = 10  # the kernels (and copies) with the most device time, per profiled step
_NAME_CHARS = 80  # cuBLAS / CUTLASS kernel names run to hundreds of characters


def device_activity(events: Iterable[tuple[str, str, int, int]]) -> dict:
    """Counts and busy time from profiler events given as (kind, name, start_ns, end_ns).

    kind is the profiler's activity type ("kernel", "gpu_memcpy", "gpu_memset",
    "cuda_runtime", "cuda_driver", "cpu_op", ...). Busy time is the union of the device
    intervals, so kernels overlapping on several streams count once.
    """
    kernels = copies = launches = graphs = cpu_ops = 0
    intervals: list[tuple[int, int]] = []
    by_name: dict[str, list[int]] = {}  # kernel or copy name -> [count, total ns]
    for kind, name, start, end in events:
        if kind in _DEVICE_KINDS:
            intervals.append((start, end))
            if kind == "kernel":
                kernels += 1
            else:
                copies += 1
            entry = by_name.setdefault(name[:_NAME_CHARS], [0, 0])
            entry[0] += 1
            entry[1] += end - start
        elif kind in ("cuda_runtime", "cuda_driver"):
            launches += name in _LAUNCH_CALLS
            graphs += name in _GRAPH_LAUNCHES
        elif kind == "cpu_op":
            cpu_ops += 1
    busy, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return dict(
        kernels=kernels,
        copies=copies,
        launch_calls=launches,
        graph_launches=graphs,
        cpu_ops=cpu_ops,
        device_busy_s=busy / 1e9,
        top_device_work=[
            dict(name=name, count=count, seconds=ns / 1e9)
            for name, (count, ns) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:_TOP]
        ],
    )


def profile(fn: Callable[[], None], device: torch.device) -> dict:
    """device_activity of one call of `fn` (CUDA activity only on a GPU: recording every
    CPU op of a GPN window would cost more than the step), plus its wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with torch_profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - start
    events = (
        (activity_kind(e), e.name(), e.start_ns(), e.end_ns())
        for e in prof.profiler.kineto_results.events()
    )
    return dict(device_activity(events), profiled_wall_s=wall)


def activity_kind(event: Any) -> str:
    """A profiler event's activity type ("kernel", "cuda_runtime", ...). torch before 2.12
    (the H200 image's 2.11) has no `activity_type()` on its events: there the kind follows
    from the device (GPU events are kernels, copies or memsets, which kineto names
    "Memcpy ..." / "Memset ...") and, on the host, from the launch calls' names."""
    if hasattr(event, "activity_type"):
        return str(event.activity_type())
    name = event.name()
    if event.device_type() == torch.autograd.DeviceType.CUDA:
        if name.startswith("Memcpy"):
            return "gpu_memcpy"
        return "gpu_memset" if name.startswith("Memset") else "kernel"
    if name.startswith("cu") and not name.startswith("cuda"):
        return "cuda_driver"
    return "cuda_runtime" if name.startswith("cuda") else "cpu_op"


# --------------------------------------------------------------------------- 3. throughput
@dataclass
class Candidate:
    """One model measured over batch sizes."""

    name: str
    family: str  # "gpn+m" / "gpn" / "transformer++"
    params: int
    vocab_size: int
    build: Callable[[], nn.Module]  # a fresh model (on the CPU)
    flops_per_token: float  # training FLOPs per token at the run's seq_len
    profile_seq_len: int  # window of the profiled step


def gpn_candidate(cfg: GPNConfig, seq_len: int) -> Candidate:
    def build() -> nn.Module:
        return GPN(cfg)

    return Candidate(
        cfg.name or "gpn",
        cfg.family,
        count_parameters(cfg),
        cfg.vocab_size,
        build,
        flops_per_token(cfg, seq_len),
        min(seq_len, PROFILE_SEQ_LEN),
    )


def transformer_candidate(like: GPNConfig, seq_len: int) -> Candidate:
    """The Transformer++ family's model (models/transformer_pp) of the GPN's size and
    embedding width, its FLOPs counted as its training runs count them."""
    from gpn_scale.models.transformer_pp import counts as tpp_counts
    from gpn_scale.models.transformer_pp.model import TransformerPP

    tcfg = tpp_counts.matching_config(like.vocab_size, like.d_emb, count_parameters(like))
    name = f"transformer++ L{tcfg.n_layers} d{tcfg.d_model} f{tcfg.d_ffn}"
    # Attention makes its cost per token depend on T: profiled on the full window.
    return Candidate(
        name,
        "transformer++",
        tpp_counts.count_parameters(tcfg),
        tcfg.vocab_size,
        lambda: TransformerPP(tcfg),
        tpp_counts.flops_per_token(tcfg, seq_len),
        seq_len,
    )


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    cand: Candidate,
    batch: int,
    seq_len: int,
    device: torch.device,
    steps: int,
    warmup: int,
    bf16: bool,
) -> dict:
    torch.manual_seed(0)
    model = cand.build().to(device)
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    tokens = torch.randint(0, cand.vocab_size, (batch, seq_len), device=device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def step(x: torch.Tensor = tokens) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = _loss(model, x)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    seconds = (time.perf_counter() - start) / steps
    tokens_per_s = batch * seq_len / seconds
    peak = device_peak_flops(device)
    row = dict(
        model=cand.name,
        family=cand.family,
        batch=batch,
        seq_len=seq_len,
        step_s=seconds,
        tokens_per_s=tokens_per_s,
        mfu=cand.flops_per_token * tokens_per_s / peak if peak else None,
        peak_allocated_gb=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        peak_reserved_gb=torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
    )
    # One profiled step (after one unprofiled step at that window: a first step at a new
    # shape may compile or capture graphs).
    short = tokens[:, : cand.profile_seq_len]
    if cand.profile_seq_len != seq_len:
        step(short)
    try:
        prof = profile(lambda: step(short), device)
    except Exception as exc:  # noqa: BLE001 - the throughput above stands without it
        traceback.print_exc()
        row["profile_error"] = error_line(exc)
        return row
    T = cand.profile_seq_len
    # Busy fraction of the timed (unprofiled) step: device time of the profiled window
    # scaled to the full window (per-step work dominates the GPN; T++ is profiled in full).
    busy = prof["device_busy_s"] * seq_len / T
    row.update(
        profiled_seq_len=T,
        kernels_per_step=prof["kernels"],
        kernels_per_time_step=prof["kernels"] / T,
        launch_calls_per_time_step=prof["launch_calls"] / T,
        graph_launches_per_step=prof["graph_launches"],
        copies_per_step=prof["copies"],
        # scaled to the full window as the busy time is (seconds per training step)
        top_device_work=[
            dict(w, seconds=w["seconds"] * seq_len / T) for w in prof["top_device_work"]
        ],
        gpu_busy_fraction=min(1.0, busy / seconds) if cuda else None,
    )
    # What the step backend's graph cache did at this batch: a capture that failed runs the
    # chunks eagerly, and the row says so instead of being taken for a graphed one.
    graphs = cuda_graphs_status()
    if graphs:
        row["cuda_graphs"] = graphs
    return row


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def batch_sizes(batches: str, min_batch: int, max_batch: int) -> Iterator[int]:
    """An explicit comma list in increasing order, or "auto": doubling from min_batch (up
    to max_batch, a guard for devices that never report out of memory, like a CPU)."""
    if batches != "auto":
        yield from sorted(int(b) for b in batches.split(","))
        return
    batch = min_batch
    while batch <= max_batch:
        yield batch
        batch *= 2


def sweep(
    cand: Candidate,
    sizes: Iterable[int],
    seq_len: int,
    device: torch.device,
    steps: int,
    warmup: int,
    bf16: bool,
    deadline: float,
    record: Callable[[dict], None],
) -> None:
    """Every batch size in turn until one does not fit or the next would overrun `deadline`.
    The next batch's predicted cost is twice the previous one's steady steps (warmup, timed
    and two profiled), not its wall time, which may hold a one-time compile or capture.
    Each row goes to `record` at once."""
    predicted = 0.0
    for batch in sizes:
        now = _clock()
        if now >= deadline or now + predicted > deadline:
            record(
                dict(
                    model=cand.name,
                    family=cand.family,
                    batch=batch,
                    skipped="time budget (--max-seconds)",
                )
            )
            return
        oom = False
        failure = None
        try:
            row = measure(cand, batch, seq_len, device, steps, warmup, bf16)
        except Exception as exc:  # out of memory ends the search; anything else is a failure
            oom = _is_oom(exc)
            if not oom:
                # recorded, and the next model still runs: device time is scarce
                traceback.print_exc()
                failure = error_line(exc)
        finally:
            # Each batch's chunk graphs (and their static copies: ~1 GiB a pair at 130M, B =
            # 16) go before the next batch or model captures its own.
            clear_cuda_graphs()
            gc.collect()  # the failed step's tensors, then the allocator's cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if oom or failure:
            outcome = dict(oom=True) if oom else dict(error=failure)
            record(dict(model=cand.name, family=cand.family, batch=batch, **outcome))
            return
        predicted = 2 * row["step_s"] * (warmup + steps + 2)
        record(row)
        print(f"  {cand.name} batch {batch}: {row['tokens_per_s']:,.0f} tokens/s", flush=True)


def best_rows(runs: list[dict]) -> dict[str, dict]:
    best: dict[str, dict] = {}
    for r in runs:
        if "tokens_per_s" in r and r["tokens_per_s"] > best.get(r["model"], {}).get(
            "tokens_per_s", 0
        ):
            best[r["model"]] = r
    return best


def ratios(runs: list[dict], candidates: list[Candidate]) -> dict[str, Any]:
    """GPN / Transformer++ tokens/s, each at its best batch."""
    best = best_rows(runs)
    tpp = next((c.name for c in candidates if c.family == "transformer++"), None)
    if tpp not in best:
        return {}
    out = {}
    for c in candidates:
        if c.family != "transformer++" and c.name in best:
            g, t = best[c.name], best[tpp]
            out[c.name] = dict(
                ratio=g["tokens_per_s"] / t["tokens_per_s"],
                batch=g["batch"],
                tokens_per_s=g["tokens_per_s"],
                transformer_batch=t["batch"],
                transformer_tokens_per_s=t["tokens_per_s"],
            )
    return out


# --------------------------------------------------------------------------- report
def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(blob: dict) -> str:
    meta = blob["meta"]
    setup = (
        f"torch {meta['torch']} (CUDA {meta['torch_cuda']}), driver {meta['driver']}; "
        f"T={meta['seq_len']}, {'bf16 autocast' if meta['bf16'] else 'fp32'}; "
        f"step kernels: {meta['step_form']}; {meta.get('elapsed_s', 0)} s of "
        f"{meta['max_seconds']:g} s"
    )
    lines = [
        f"# Device check: {meta['device_name']}",
        "",
        setup,
        "",
        "| check | result | ok |",
        "|---|---|---|",
    ]
    for c in blob["checks"]:
        detail = {k: v for k, v in c.items() if k not in ("check", "ok")}
        lines.append(f"| {c['check']} | {detail} | {'yes' if c['ok'] else '**NO**'} |")
    header = (
        "| model | params | batch | tokens/s | MFU | peak alloc GB | peak reserved GB "
        "| GPU busy | kernels / time step | launch calls / time step | step s |"
    )
    lines += ["", header, "|---|---|---|---|---|---|---|---|---|---|---|"]
    params = meta.get("params", {})
    for r in blob["runs"]:
        head = f"| {r['model']} | {params.get(r['model'], 0):,} | {r['batch']} |"
        if "tokens_per_s" not in r:
            why = "out of memory" if r.get("oom") else r.get("skipped") or f"**{r.get('error')}**"
            lines.append(head + f" {why} | | | | | | | |")
            continue
        lines.append(
            head + f" {r['tokens_per_s']:,.0f} | {_fmt(r['mfu'], '.1%')} | "
            f"{_fmt(r['peak_allocated_gb'], '.1f')} | {_fmt(r['peak_reserved_gb'], '.1f')}"
            f" | {_fmt(r.get('gpu_busy_fraction'), '.0%')} | "
            f"{_fmt(r.get('kernels_per_time_step'), '.1f')} | "
            f"{_fmt(r.get('launch_calls_per_time_step'), '.1f')} | {r['step_s']:.3f} |"
        )
    for name, r in best_rows(blob["runs"]).items():
        if r.get("top_device_work"):
            lines += ["", f"Device time by kernel, {name} at B={r['batch']} (s per step):"]
            lines += [
                f"- {w['seconds']:.4f} s ({w['seconds'] / r['step_s']:.0%}), {w['count']}x "
                f"per profiled window: `{w['name']}`"
                for w in r["top_device_work"]
            ]
    ratio = blob["summary"].get("ratio_to_transformer_pp", {})
    if ratio:
        lines += ["", "GPN / Transformer++ tokens/s, each at its best batch:"]
        for name, x in ratio.items():
            lines.append(
                f"- {name}: **{x['ratio']:.2f}x** ({x['tokens_per_s']:,.0f} at B="
                f"{x['batch']} vs {x['transformer_tokens_per_s']:,.0f} at B="
                f"{x['transformer_batch']})"
            )
    return "\n".join(lines) + "\n"


def _step_form(device: torch.device) -> str:
    """The step backend the GPN runs on `device` (cuda: the Triton kernels; cpu: the fused
    C++ kernels; reference: the PyTorch steps)."""
    from gpn_scale.ops.gpn_step.registry import select_backend

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fallback's warning comes again at the first step
        return select_backend("auto", device).name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for results.json / results.md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--config",
        default="gpn_m_130m,gpn_m_130m_2l",
        help="comma-separated model configs (names or paths); the "
        "Transformer++ matches the first one's parameter count",
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--batches",
        default="auto",
        help="'auto' (doubling from --min-batch up to the first that does not "
        "fit) or a comma-separated list",
    )
    parser.add_argument("--min-batch", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per batch size")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    parser.add_argument(
        "--no-transformer", action="store_true", help="skip the Transformer++ baseline"
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=450.0,
        help="time budget for the whole check (default fits 8 min on an H200)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    parser.add_argument(
        "--triton-cache",
        type=Path,
        default=default_triton_cache(),
        help="Triton cache the check's kernels are compiled into first, then used "
        "(default .cache/triton-device)",
    )
    parser.add_argument(
        "--no-prebuild", action="store_true", help="compile kernels on first use instead"
    )
    args = parser.parse_args(argv)
    t0 = _clock()
    device = torch.device(args.device)
    if device.type == "cuda":
        problem = cuda_problem()
        if problem:
            print(
                f"device check: CUDA is not usable on --device {args.device} ({problem}); "
                f"torch {torch.__version__} built for CUDA {torch.version.cuda}, driver "
                f"{driver_version()}; nothing measured (--device cpu runs the smoke mode)",
                file=sys.stderr,
                flush=True,
            )
            return EXIT_NO_CUDA
    out = Path(args.out)
    if (out / "results.json").exists() and not args.overwrite:
        print(
            f"device check: {out / 'results.json'} exists; pick another --out or pass --overwrite",
            file=sys.stderr,
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    configs = [load_model_config(name) for name in args.config.split(",")]
    candidates = [gpn_candidate(cfg, args.seq_len) for cfg in configs]
    if not args.no_transformer:
        candidates.append(transformer_candidate(configs[0], args.seq_len))
    meta = dict(
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        driver=driver_version() if device.type == "cuda" else "-",
        device=str(device),
        device_name=(torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"),
        seq_len=args.seq_len,
        bf16=not args.fp32,
        step_form=_step_form(device),
        max_seconds=args.max_seconds,
        params={c.name: c.params for c in candidates},
        _t0=t0,
    )
    results = Results(out, meta)
    results.save()
    print(f"device check on {meta['device_name']} (torch {meta['torch']})", flush=True)
    if device.type == "cuda":
        if not args.no_prebuild:
            major, minor = torch.cuda.get_device_capability(device)
            meta["triton_prebuild"] = prebuild_triton_cache(
                args.triton_cache,
                args.config.split(","),
                args.seq_len,
                f"sm_{major}{minor}",
                out / "triton-prebuild.log",
                timeout_s=args.max_seconds / 4,
            )
            print(f"  Triton kernels prebuilt: {meta['triton_prebuild']}", flush=True)
            results.save()
        use_triton_cache(args.triton_cache)
    for row in [*check_exactness(device), *check_gated_deltanet_fla(device)]:
        results.checks.append(row)
        results.save()
        print(f"  {row['check']}: {'ok' if row['ok'] else 'FAILED'} {row}", flush=True)

    def record(row: dict) -> None:
        results.runs.append(row)
        results.summary["ratio_to_transformer_pp"] = ratios(results.runs, candidates)
        results.save()

    deadline = t0 + args.max_seconds
    for i, cand in enumerate(candidates):
        now = _clock()
        share = now + (deadline - now) / (len(candidates) - i)
        sweep(
            cand,
            batch_sizes(args.batches, args.min_batch, args.max_batch),
            args.seq_len,
            device,
            args.steps,
            args.warmup,
            not args.fp32,
            share,
            record,
        )
    results.save()
    report = markdown(json.loads((out / "results.json").read_text()))
    print(report)
    return 0 if all(c["ok"] for c in results.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
