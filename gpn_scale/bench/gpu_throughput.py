"""The device check's throughput (`bench/gpu.py`, step 2): each model over batch sizes at the
run's T, bf16 autocast and fused AdamW (tokens/s, MFU, memory), and one profiled step per row
(kernels, launches, device busy time over the whole step, the kernels with the most device
time). The GPN, and the Transformer++ of its size eager and compiled (`compile.enable`), the
anchor users would otherwise train."""

from __future__ import annotations

import dataclasses
import gc
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpn_scale.accounting import device_runs
from gpn_scale.bench.gpu_exactness import error_line
from gpn_scale.core.hardware import device_peak_flops
from gpn_scale.models.gpn import GPN, GPNConfig
from gpn_scale.models.gpn.counts import count_parameters, flops_per_token
from gpn_scale.ops.gpn_step.registry import clear_cuda_graphs, cuda_graphs_status
from gpn_scale.ops.gpn_step.workspace import release_workspaces


def _clock() -> float:
    """The budget's clock (a seam for tests)."""
    return time.perf_counter()


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
    config: str = ""  # the model config it was built from (results.json's summary names it)
    compiled: bool = False  # torch.compile on its blocks (compile.enable)


def gpn_candidate(cfg: GPNConfig, seq_len: int) -> Candidate:
    def build() -> nn.Module:
        return GPN(cfg)

    # Profiled over its full window: ~20 kernels per time step with the CUDA backend (the
    # PyTorch steps' ~450 overflowed the profiler's buffers at T = 2048).
    return Candidate(
        cfg.name or "gpn",
        cfg.family,
        count_parameters(cfg),
        cfg.vocab_size,
        build,
        flops_per_token(cfg, seq_len),
        seq_len,
        config=cfg.name or "gpn",
    )


# The engine options the device check also times the first config with changed, one row each
# at the last ledger batch (issue 34): what each is predicted to save, measured beside it.
ENGINE_AB: tuple[tuple[str, dict[str, Any]], ...] = (
    ("overlap off", dict(overlap_backward=False, overlap_decode=False)),
    ("dependent launch off", dict(dependent_launch=False)),
    ("side-work SMs off", dict(side_work_sm_share=0.0)),
    # changes results (off by default): what reading M0 in bf16 saves, beside its exactness
    # row (bench/gpu_exactness.BF16_READS_CHECK)
    ("bf16 memory reads", dict(bf16_memory_reads=True)),
    # every step GEMM a cuBLAS product, its scale and epilogue after (the same function):
    # the whole step with it, where the ceilings time cuBLAS alone at each projection's shapes
    ("cuBLAS step GEMMs", dict(cublas_gemms="all")),
)


def candidates(
    configs: list[GPNConfig],
    seq_len: int,
    transformer: bool,
    compiled: bool,
    ab_batch: int | None,
) -> tuple[list[Candidate], dict[str, list[int]]]:
    """The device check's models in order (each GPN config; the first again with each of
    `ENGINE_AB`'s options changed, at `ab_batch` only; the Transformer++ of the first config's
    size, eager and `compiled`), and the batches of those measured at a few only."""
    found = [gpn_candidate(cfg, seq_len) for cfg in configs]
    only_at: dict[str, list[int]] = {}
    if ab_batch is not None:
        for i, (label, off) in enumerate(ENGINE_AB, start=1):
            plain = gpn_candidate(configs[0].replace(**off), seq_len)
            flags = " ".join(f"engine.{k}={str(v).lower()}" for k, v in off.items())
            plain = dataclasses.replace(
                plain, name=f"{plain.name} ({label})", config=f"{plain.config} {flags}"
            )
            found.insert(i, plain)
            only_at[plain.name] = [ab_batch]
    if transformer:
        found.append(transformer_candidate(configs[0], seq_len))
        if compiled:
            found.append(transformer_candidate(configs[0], seq_len, True))
    return found, only_at


def transformer_candidate(like: GPNConfig, seq_len: int, compiled: bool = False) -> Candidate:
    """The Transformer++ family's model (models/transformer_pp) of the GPN's size and
    embedding width, its FLOPs counted as its training runs count them; `compiled`: with
    torch.compile on its blocks as `compile.enable` puts it (parallel/compile.py), the
    anchor users would otherwise train."""
    from gpn_scale.accounting.baseline_model import matched_transformer
    from gpn_scale.models.registry import family_of
    from gpn_scale.models.transformer_pp import counts as tpp_counts
    from gpn_scale.models.transformer_pp.model import TransformerPP
    from gpn_scale.parallel.compile import apply_compile

    tcfg = matched_transformer(like)
    name = tcfg.name

    def build() -> nn.Module:
        model = TransformerPP(tcfg)
        spec = family_of(tcfg)
        if compiled and spec.compile_blocks is not None:
            apply_compile(spec.compile_blocks(model), spec.compile_fullgraph, log=lambda _: None)
        return model

    # Attention makes its cost per token depend on T: profiled on the full window.
    return Candidate(
        name + (device_runs.COMPILED if compiled else ""),
        "transformer++",
        tpp_counts.count_parameters(tcfg),
        tcfg.vocab_size,
        build,
        tpp_counts.flops_per_token(tcfg, seq_len),
        seq_len,
        config=name,
        compiled=compiled,
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
    # Device busy time over the profiled step's own wall time, both of one full window: not
    # clamped (a figure over 1 would say the two clocks disagree, and is kept as such).
    scale = seq_len / T
    row.update(
        profiled_seq_len=T,
        kernels_per_step=prof["kernels"],
        kernels_per_time_step=prof["kernels"] / T,
        launch_calls_per_time_step=prof["launch_calls"] / T,
        graph_launches_per_step=prof["graph_launches"],
        copies_per_step=prof["copies"],
        # scaled to the full window as the busy time is (seconds per training step)
        top_device_work=[dict(w, seconds=w["seconds"] * scale) for w in prof["top_device_work"]],
        device_busy_s=prof["device_busy_s"] * scale,
        profiled_wall_s=prof["profiled_wall_s"] * scale,
        gpu_busy_fraction=prof["device_busy_s"] / prof["profiled_wall_s"] if cuda else None,
        compiled=cand.compiled,
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
            # Each batch's chunk graphs (and their static copies: ~6 GiB at 130M, B = 128)
            # and the sweep's kept adjoint workspaces go before the next batch or model.
            clear_cuda_graphs()
            release_workspaces()
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


def ratios(runs: list[dict], candidates: list[Candidate], compiled: bool = False) -> dict[str, Any]:
    """GPN / Transformer++ tokens/s, each at its best batch; against the compiled
    Transformer++ (compile.enable) or the eager one."""
    best = best_rows(runs)
    tpp = next(
        (c.name for c in candidates if c.family == "transformer++" and c.compiled == compiled),
        None,
    )
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
                transformer="compiled" if compiled else "eager",
            )
    return out


def summary(runs: list[dict], candidates: list[Candidate]) -> dict[str, Any]:
    """results.json's summary: each model's rows, the ratios to the eager and the compiled
    Transformer++, and the headline (the first GPN against the compiled one)."""
    configs = {c.name: c.config or c.name for c in candidates}
    eager = ratios(runs, candidates)
    compiled = ratios(runs, candidates, compiled=True)
    first = next((c.name for c in candidates if c.family != "transformer++"), None)
    headline = compiled.get(first, {}).get("ratio") if first else None
    out = device_runs.summary(runs, configs, headline)
    out["ratio_to_transformer_pp"] = eager
    out["ratio_to_compiled_transformer_pp"] = compiled
    return out
