"""Scheduled profiling (`profiling.*`, torchtitan's profiling section): torch.profiler
windows over the training steps, one Chrome trace per rank and window, and CUDA memory
snapshots, written to a local folder or an S3 prefix through io/storage/.

The schedule counts steps as the run does (1-based, across resumes). A window ends at every
multiple of `every`; its last `active` steps are recorded, after `warmup` steps that run the
profiler without recording (its start-up cost stays out of the trace); every other step runs
without it. every=100, warmup=3, active=1: step 100 is recorded after 97-99, then 200, ...
A window that began before this process's first step (a resume inside it) or that the run
leaves unfinished (the last step, a stop) is not written: a trace always holds `active` steps.

Files (keys under profiling.folder, default <run_dir>/profiling):

    rank<r>_step<n>.json            Chrome trace of the window ending at step n: open it in
                                    chrome://tracing or https://ui.perfetto.dev; each step
                                    is a `ProfilerStep#<n>` span
    rank<r>_step<n>_memory.pickle   CUDA memory snapshot after step n (n a multiple of
                                    `every`): https://pytorch.org/memory_viz
    rank<r>_step<n>_oom.pickle      the snapshot when step n ran out of CUDA memory

The hook in the loop is `open_profiler` before the steps, `.step(n)` after each and
`.close()` when they end (normally or not). Off (the default) costs nothing: `open_profiler`
returns `OFF`, whose methods do nothing; no torch profiler is made, no history recorded.
A trace or snapshot that cannot be written mid-run is one line in the log and the run goes
on (a profile is a diagnosis, not a result); a folder that cannot be written at all stops the
run before its first step (exit 2).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from gpn_scale.core.config import ConfigError
from gpn_scale.io.storage import Storage, join, one_line, open_storage
from gpn_scale.run.config import ProfilingSection

# What the profiler does during one step (torch.profiler.ProfilerAction, as plain names so
# that the schedule is a pure function).
NONE, WARMUP, RECORD, SAVE = "none", "warmup", "record", "save"


def action_at(step: int, every: int, warmup: int, active: int, start: int = 0) -> str:
    """The profiler's action during training step `step` (1-based) of a process whose first
    step is `start + 1`: SAVE on a window's last step (a multiple of `every`), RECORD on the
    active steps before it, WARMUP on the `warmup` steps before those, NONE elsewhere and in
    a window that began at or before `start` (it would hold fewer steps than asked)."""
    end = -(-step // every) * every  # the window's last step: the next multiple of `every`
    first = end - active - warmup + 1
    if first <= start:
        return NONE
    if step == end:
        return SAVE
    if step > end - active:
        return RECORD
    return WARMUP if step >= first else NONE


def trace_name(rank: int, step: int, kind: str = "") -> str:
    """The key of a trace (kind "") or memory snapshot (kind "memory" / "oom")."""
    return f"rank{rank}_step{step}_{kind}.pickle" if kind else f"rank{rank}_step{step}.json"


class MemoryHistory(Protocol):
    """Where memory snapshots come from (CUDA's allocator; a fake in the tests)."""

    def start(self) -> None: ...
    def dump(self, path: Path) -> None: ...
    def stop(self) -> None: ...


class CudaMemoryHistory:
    """The CUDA caching allocator's history of allocations (torch.cuda.memory's private
    API, the one PyTorch's memory_viz documents; torchtitan records the same)."""

    MAX_ENTRIES = 100_000  # allocation events kept (torchtitan's figure)

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=self.MAX_ENTRIES)

    def dump(self, path: Path) -> None:
        torch.cuda.memory._dump_snapshot(str(path))

    def stop(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)


def cuda_memory_history(device: torch.device) -> CudaMemoryHistory | None:
    """The history recorder for `device`, or None where there is no CUDA (CPU runs)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return CudaMemoryHistory()


class Off:
    """Profiling off: the loop's calls do nothing."""

    def step(self, step: int) -> None:
        pass

    def close(self, exc: BaseException | None = None) -> None:
        pass


OFF = Off()


def open_profiler(
    section: ProfilingSection,
    rank: int,
    run_dir: str,
    start_step: int,
    device: torch.device,
    log: Callable[[str], None],
) -> StepProfiler | Off:
    """The run's profiler from its last completed step `start_step`, or OFF (nothing made).
    A folder that cannot be written is a ConfigError (exit 2) naming it and the fix."""
    if not section.enable and not section.memory_snapshot:
        return OFF
    memory = cuda_memory_history(device) if section.memory_snapshot else None
    if section.memory_snapshot and memory is None:
        log(f"profiling.memory_snapshot: no CUDA device ({device.type}): no memory snapshots")
        if not section.enable:
            return OFF
    folder = section.folder or join(run_dir, "profiling")
    storage = open_storage(folder, error=ConfigError, subject="profiling folder")
    storage.preflight()
    prof = StepProfiler(section, rank, storage, start_step, log, memory, device.type)
    what = [f"traces (warmup {section.warmup}, active {section.active})"] if section.enable else []
    what += ["CUDA memory snapshots"] if memory is not None else []
    log(
        f"profiling: {' and '.join(what)} every {section.every} steps -> "
        f"{storage.uri}/{trace_name(rank, section.every)}, ..."
    )
    return prof


class StepProfiler:
    """torch.profiler on `action_at`'s schedule and memory snapshots, for one rank."""

    def __init__(
        self,
        section: ProfilingSection,
        rank: int,
        storage: Storage,
        start_step: int,
        log: Callable[[str], None],
        memory: MemoryHistory | None = None,
        device_type: str = "cpu",
    ) -> None:
        self.section, self.rank, self.storage = section, rank, storage
        self.start_step = start_step
        self._done = start_step  # the last completed step
        self._saving = False  # set while a window's last step hands its trace over
        self._log = log
        # Every rank reports its own failed writes; the progress lines are rank 0's.
        self._warn = log if rank == 0 else (lambda m: print(m, file=sys.stderr, flush=True))
        local = storage.local_dir("")
        self._stage = local if local is not None else Path(tempfile.mkdtemp(prefix="gpn_prof_"))
        self._own_stage = local is None
        self._memory = memory
        if memory is not None:
            memory.start()
        self._prof: Any = None
        if section.enable:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device_type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(
                activities=activities,
                schedule=self._schedule,
                on_trace_ready=self._trace_ready,
                record_shapes=True,
            )
            self._prof.step_num = start_step + 1  # the trace's ProfilerStep#<n> is step n
            self._prof.start()

    def _action(self, step: int) -> str:
        s = self.section
        return action_at(step, s.every, s.warmup, s.active, self.start_step)

    def _schedule(self, _profiler_step: int) -> Any:
        """The action for the step about to run (by our count, not the profiler's)."""
        return {
            NONE: torch.profiler.ProfilerAction.NONE,
            WARMUP: torch.profiler.ProfilerAction.WARMUP,
            RECORD: torch.profiler.ProfilerAction.RECORD,
            SAVE: torch.profiler.ProfilerAction.RECORD_AND_SAVE,
        }[self._action(self._done + 1)]

    def step(self, step: int) -> None:
        """Training step `step` is done: end a window there, snapshot memory there."""
        self._done = step
        if self._prof is not None:
            self._saving = self._action(step) == SAVE
            try:
                self._prof.step_num = step  # the next span is ProfilerStep#<step + 1>
                with warnings.catch_warnings():  # "clears events at the end of each cycle":
                    warnings.filterwarnings("ignore", "Warning: Profiler clears events")
                    self._prof.step()  # one trace per window is what we ask for
            finally:
                self._saving = False
        if self._memory is not None and step % self.section.every == 0:
            self._write(trace_name(self.rank, step, "memory"), self._memory.dump)

    def _trace_ready(self, prof: Any) -> None:
        """torch's hand-over of a recorded window; one left unfinished (at stop) is dropped."""
        if not self._saving:
            return
        t0 = time.perf_counter()
        key = trace_name(self.rank, self._done)
        if self._write(key, lambda path: prof.export_chrome_trace(str(path))):
            self._log(
                f"profiling: step {self._done} trace -> {self.storage.child_uri(key)} "
                f"({time.perf_counter() - t0:.1f}s)"
            )

    def _write(self, key: str, produce: Callable[[Path], None]) -> bool:
        """Produce a file beside its destination (or in a temporary folder for S3), then
        hand it to the storage (a local folder renames it into place: never half a file)."""
        staged = self._stage / f".{key}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            self._stage.mkdir(parents=True, exist_ok=True)
            produce(staged)
            if not staged.is_file():  # Kineto logs a failed export and returns as if written
                raise OSError(f"the profiler wrote no file at {staged}")
            self.storage.put_file(staged, key)
            return True
        except (ConfigError, OSError, RuntimeError) as exc:
            why = str(exc) if isinstance(exc, ConfigError) else one_line(exc)  # ours: one line
            self._warn(
                f"profiling: could not write {self.storage.child_uri(key)} ({why}); "
                "training goes on"
            )
            return False
        finally:
            staged.unlink(missing_ok=True)

    def close(self, exc: BaseException | None = None) -> None:
        """Stop profiling (an unfinished window is dropped); a snapshot when the steps ended
        in a CUDA out-of-memory error (`exc`, else the exception in flight: the loop calls
        this from its `finally`)."""
        exc = exc if exc is not None else sys.exc_info()[1]
        try:
            if self._prof is not None:
                self._prof.__exit__(None, None, None)
                self._prof = None
            if self._memory is not None:
                if isinstance(exc, torch.OutOfMemoryError):
                    self._write(trace_name(self.rank, self._done + 1, "oom"), self._memory.dump)
                self._memory.stop()
                self._memory = None
        except Exception as err:  # never mask the error that ended the steps
            self._warn(f"profiling: stopping the profiler failed ({one_line(err)})")
        finally:
            if self._own_stage:
                shutil.rmtree(self._stage, ignore_errors=True)
