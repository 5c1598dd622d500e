"""What a run prints while it trains: the progress bar or plain lines, the end-of-run
summary, and the first-step notice on a GPU."""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def progress_bar(step: int, total: int, enabled: bool) -> Any:
    """A tqdm bar on stderr, or None where stderr is no terminal (a SLURM log, a pipe):
    carriage-return redraws would fill the file; the loop prints a plain line every
    train.log_every steps instead."""
    if not (enabled and sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=step,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
        file=sys.stderr,
    )


def progress_line(
    step: int,
    total: int,
    loss: float,
    lr: float,
    tokens_per_s: float,
    mfu: float | None,
    s_per_step: float,
) -> str:
    """The plain progress line written instead of the tqdm bar when stderr is no terminal
    (a SLURM log, a pipe), led by the wall-clock time (ISO 8601, local time with its UTC
    offset: one format whatever the locale, sortable, and comparable across nodes)."""
    eta = int(round(s_per_step * (total - step)))
    return (
        f"{timestamp()} step {step}/{total} | loss {loss:.4f} | lr {lr:.3e} | "
        f"{tokens_per_s:,.0f} tok/s"
        f" | MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}"
        f" | ETA {eta // 3600}:{eta % 3600 // 60:02d}:{eta % 60:02d}"
    )


def timestamp() -> str:
    """Now, as 2025-01-31T14:05:09+01:00 (seconds; the offset names the zone)."""
    import datetime as dt

    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def run_summary(
    steps: int, wall_s: float, mean_tokens_per_s: float | None, mean_mfu: float | None
) -> str:
    """The end-of-run line: steps trained by this process, their wall time, and the mean
    tokens/s and MFU per step (the first step, which builds the kernels, left out when
    there are others)."""
    tps = "n/a" if mean_tokens_per_s is None else f"{mean_tokens_per_s:,.0f}"
    mfu = "n/a" if mean_mfu is None else f"{100 * mean_mfu:.1f}%"
    return (
        f"summary: {steps} step(s) in {_clock(wall_s)} wall time | mean {tps} tok/s | "
        f"mean MFU {mfu}"
    )


class FirstStepNotice:
    """On a GPU, one line when the first step of a process is still running after `after_s`
    seconds: Triton compiles the kernels it launches there (cached for later runs), which
    can take a minute or more, and a silent `step 1` looks like a hang. (On a CPU the fused
    step kernels say so themselves before they compile: gpn_scale/ops/gpn_step/step_kernels.py.)
    GPN_SCALE_SLOW_STEP_S sets the wait (default 20 s)."""

    def __init__(
        self, log: Callable[[str], None], device_type: str, step: int, after_s: float | None = None
    ) -> None:
        import threading

        self._timer: Any = None
        if device_type != "cuda":
            return
        if after_s is None:
            after_s = float(os.environ.get("GPN_SCALE_SLOW_STEP_S", "20"))
        cache = os.environ.get("TRITON_CACHE_DIR") or "~/.triton/cache"
        self._message = (
            f"step {step} is still running after {after_s:g}s: the first step on a GPU "
            f"compiles its Triton kernels (once; cached in {cache}, later runs start at once)"
        )
        self._log = log
        self._timer = threading.Timer(after_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self._log(self._message)

    def done(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Throughput:
    """Tokens/s and MFU of each step, and their means over this process's steps for the
    summary (the first step, which builds the kernels, left out when there are others)."""

    def __init__(
        self,
        step0: int,
        total: int,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: float | None,
        world_size: int,
    ) -> None:
        self.step0, self.total, self.tokens_per_step = step0, total, tokens_per_step
        self.flops_per_token, self.peak, self.world_size = flops_per_token, peak_flops, world_size
        self.t_start = time.perf_counter()  # for the ETA of the plain progress lines
        self._tps_sum, self._mfu_sum, self._timed = 0.0, 0.0, 0

    def add(self, step: int, dt: float) -> tuple[float, float | None]:
        """(tokens/s, MFU or None without a known peak) of step `step`, which took dt s."""
        tps = self.tokens_per_step / dt
        mfu = (self.flops_per_token * tps / (self.peak * self.world_size)) if self.peak else None
        if step > self.step0 + 1 or self.total - self.step0 == 1:
            self._tps_sum += tps
            self._mfu_sum += mfu or 0.0
            self._timed += 1
        return tps, mfu

    def steps(self, step: int) -> int:
        return step - self.step0

    def s_per_step(self, step: int) -> float:
        return (time.perf_counter() - self.t_start) / (step - self.step0)

    def summary(self, step: int) -> str:
        timed = self._timed
        return run_summary(
            step - self.step0,
            time.perf_counter() - self.t_start,
            self._tps_sum / timed if timed else None,
            self._mfu_sum / timed if timed and self.peak else None,
        )
