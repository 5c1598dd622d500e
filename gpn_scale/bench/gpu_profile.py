"""The device check's views inside one GPN training step (`bench/gpu.py`): its time by engine
phase (CUDA events), a Chrome trace of a short window, and Nsight Compute's counters on the
ledger's replay of the top kernels. Each is best effort: a failure is one line in
results.json, and the rest of the check runs."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gpn_scale.models.gpn import GPN, GPNConfig
from gpn_scale.ops.gpn_step import phases as phases_

# What the step does outside the engine's phases is charged here.
OPTIMIZER = "optimizer"
REST = "the rest (embedding, loss sum, autograd glue)"


def _warm_step(cfg: GPNConfig, batch: int, seq_len: int, device: torch.device, bf16: bool):
    """A fresh model's forward-backward and optimizer at (batch, seq_len), after one
    warm-up step (kernels compiled, chunk graphs captured)."""
    torch.manual_seed(0)
    model = GPN(cfg).to(device)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    forward_backward, opt = _step_fn(model, tokens, bf16)
    forward_backward()
    opt.step()
    _sync(device)
    return forward_backward, opt


def _step_fn(model: torch.nn.Module, tokens: torch.Tensor, bf16: bool):
    device = tokens.device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def forward_backward() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(tokens)
        out.loss.backward()

    return forward_backward, opt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def phase_split(
    cfg: GPNConfig, batch: int, seq_len: int, device: torch.device, bf16: bool = True
) -> dict[str, Any]:
    """Seconds of one training step by engine phase (sequential forward, reverse sweep,
    recompute, memory carry, weight gradients, decode/loss), the optimizer step, and the
    rest (the step's time less those), after one warm-up step (graphs captured)."""
    forward_backward, opt = _warm_step(cfg, batch, seq_len, device, bf16)
    timer = _Events(device)
    with phases_.phase_timer() as seconds:
        timer.start()
        forward_backward()
        timer.mark()
        opt.step()
        timer.mark()
    step, optimizer = timer.read()
    engine = dict(seconds)
    total = step + optimizer
    out = {
        "config": cfg.name,
        "batch": batch,
        "seq_len": seq_len,
        "step_s": total,
        "phases_s": {**engine, OPTIMIZER: optimizer, REST: max(0.0, step - sum(engine.values()))},
    }
    sequential = sum(v for k, v in engine.items() if k.startswith("sequential"))
    out["sequential_share"] = sequential / total if total else None
    return out


class _Events:
    """Marks on the stream (CUDA events) or the wall clock (CPU): the intervals between."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def _now(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self) -> None:
        self.marks = [self._now()]

    def mark(self) -> None:
        self.marks.append(self._now())

    def read(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def chrome_trace(
    cfg: GPNConfig, batch: int, seq_len: int, device: torch.device, out: Path, bf16: bool = True
) -> dict[str, Any]:
    """A gzipped Chrome trace (chrome://tracing, Perfetto) of one training step over a
    `seq_len` window, after one warm-up step."""
    from torch.profiler import ProfilerActivity, profile

    forward_backward, opt = _warm_step(cfg, batch, seq_len, device, bf16)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    raw = out.with_suffix("")  # trace.json
    with profile(activities=activities) as prof:
        forward_backward()
        opt.step()
        _sync(device)
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return {
        "trace": out.name,
        "config": cfg.name,
        "batch": batch,
        "seq_len": seq_len,
        "bytes": out.stat().st_size,
    }


# Nsight Compute: DRAM throughput, L2 hit rate, achieved occupancy and the issue-stall
# reasons of each profiled kernel (section names are ncu's own).
NCU_METRICS = (
    "gpu__time_duration.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sector_hit_rate.pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__average_warp_latency_issue_stalled_long_scoreboard",
    "smsp__average_warp_latency_issue_stalled_barrier",
    "smsp__average_warp_latency_issue_stalled_wait",
    "launch__registers_per_thread",
    "launch__occupancy_limit_registers",
)


def ncu_counters(
    config: str, batch: int, kernels: list[str], out: Path, timeout_s: float, device: str = "cuda"
) -> dict[str, Any]:
    """Nsight Compute (`--clock-control none`, METHOD.md) on the ledger's replay of `kernels`
    (their Triton names), one launch each; its CSV under `out`. Without ncu, or when it
    fails or runs past `timeout_s`, one line saying so."""
    ncu = shutil.which("ncu") or next(
        (str(p) for p in Path("/opt/nvidia").glob("nsight-compute/*/ncu") if p.is_file()), None
    )
    if ncu is None:
        return {"ok": False, "error": "ncu not found on PATH or under /opt/nvidia"}
    csv = out / "ncu.csv"
    scratch = out / "ncu-ledger"
    cmd = [
        ncu,
        "--clock-control",
        "none",
        "--csv",
        "--page",
        "raw",
        "--metrics",
        ",".join(NCU_METRICS),
        "--kernel-name",
        f"regex:^({'|'.join(kernels)})$",
        "--launch-count",
        str(2 * len(kernels)),
        sys.executable,
        "-m",
        "gpn_scale.bench.gpu_ledger",
        "--device",
        device,
        "--config",
        config,
        "--batches",
        str(batch),
        "--repeats",
        "1",
        "--out",
        str(scratch),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"ncu ran past {timeout_s:.0f} s"}
    except OSError as exc:
        return {"ok": False, "error": f"ncu did not start: {exc}"}
    csv.write_text(done.stdout)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"ok": False, "error": f"ncu exit {done.returncode}: {last[:300]}", "csv": csv.name}
    return {"ok": True, "csv": csv.name, "metrics": list(NCU_METRICS), "kernels": kernels}
