"""Time per engine phase, for the benchmarks and the launch accounting only.

`phase_timer()` turns it on around a block; the sequence op and the model mark their phases
(`phase(name, device)`); `current_phase()` names the innermost one open (the launch
accounting attributes each kernel launch to it). Off, a phase costs one global read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

_PHASES: dict[str, float] | None = None  # set by `phase_timer()` (benchmarks only)
_PENDING: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []


@contextlib.contextmanager
def phase_timer() -> Iterator[dict[str, float]]:
    """Accumulate time per engine phase while active (for `gpn_scale.bench.engine`). On CUDA
    a phase is timed by events on the stream (wall time would charge the kernels queued by
    one phase to whichever later phase waits for them); they are read when the block ends."""
    global _PHASES
    previous, _PHASES = _PHASES, {}
    phases = _PHASES
    try:
        yield phases
    finally:
        if _PENDING:
            torch.cuda.synchronize()
            for name, begin, end in _PENDING:
                phases[name] = phases.get(name, 0.0) + begin.elapsed_time(end) / 1e3
            _PENDING.clear()
        _PHASES = previous


_CURRENT: list[str] = []  # the phases open now, innermost last (while phase_timer is on)


def current_phase() -> str | None:
    """The innermost engine phase running now, when phases are being timed (accounting)."""
    return _CURRENT[-1] if _CURRENT else None


@contextlib.contextmanager
def phase(name: str, device: torch.device | None = None) -> Iterator[None]:
    if _PHASES is None:
        yield
        return
    _CURRENT.append(name)
    try:
        with _timed_phase(name, device):
            yield
    finally:
        _CURRENT.pop()


@contextlib.contextmanager
def _timed_phase(name: str, device: torch.device | None) -> Iterator[None]:
    assert _PHASES is not None
    if device is not None and device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        try:
            yield
        finally:
            end.record()
            _PENDING.append((name, begin, end))
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        _PHASES[name] = _PHASES.get(name, 0.0) + time.perf_counter() - start
