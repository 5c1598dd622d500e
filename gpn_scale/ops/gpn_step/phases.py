"""Time per engine phase, for the benchmarks and the launch accounting only.

`phase_timer()` turns it on around a block; the sequence op and the model mark their phases
(`phase(name, device)`); `current_phase()` names the innermost one open (the launch
accounting attributes each kernel launch to it). Off, a phase costs one attribute read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from gpn_scale.ops.execution import current, execution


class _PhaseTimes:
    """What one `phase_timer()` block accumulates: seconds per phase, the CUDA events not
    read yet, and the phases open now (innermost last)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.open: list[str] = []

    def read_events(self) -> None:
        if self.pending:
            torch.cuda.synchronize()
            for name, begin, end in self.pending:
                self.add(name, begin.elapsed_time(end) / 1e3)
            self.pending.clear()

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


@contextlib.contextmanager
def phase_timer() -> Iterator[dict[str, float]]:
    """Accumulate time per engine phase while active (for `gpn_scale.bench.engine`). On CUDA
    a phase is timed by events on the stream (wall time would charge the kernels queued by
    one phase to whichever later phase waits for them); they are read when the block ends."""
    times = _PhaseTimes()
    with execution(phases=times):
        try:
            yield times.seconds
        finally:
            times.read_events()


def current_phase() -> str | None:
    """The innermost engine phase running now, when phases are being timed (accounting)."""
    times = current().phases
    return times.open[-1] if times is not None and times.open else None


@contextlib.contextmanager
def phase(name: str, device: torch.device | None = None) -> Iterator[None]:
    times = current().phases
    if times is None:
        yield
        return
    times.open.append(name)
    try:
        with _timed_phase(times, name, device):
            yield
    finally:
        times.open.pop()


@contextlib.contextmanager
def _timed_phase(times: _PhaseTimes, name: str, device: torch.device | None) -> Iterator[None]:
    if device is not None and device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        try:
            yield
        finally:
            end.record()
            times.pending.append((name, begin, end))
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        times.add(name, time.perf_counter() - start)
