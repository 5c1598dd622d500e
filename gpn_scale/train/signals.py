"""Preemption: a signal only sets a flag; the loop acts on it at the next step boundary.

SIGUSR1 (what SLURM sends with `--signal=USR1@<secs>` before the time limit) and SIGTERM
(what SLURM / Kubernetes / spot reclaimers send before killing) set `PreemptionFlag.requested`.
At the end of every step all ranks agree on the flag (an all-reduce MAX, so one rank's signal
stops everyone at the same step), save a checkpoint and exit with EXIT_PREEMPTED.
Doing nothing else in the handler keeps it safe: no I/O or collectives from signal context.

SIGINT (Ctrl-C; what `srun` forwards) does the same (save at the step's end, exit 75; no
requeue: someone asked to stop), plus one line on stderr written straight to fd 2 (os.write
is safe in a handler, print is not); a second Ctrl-C raises KeyboardInterrupt: abort at
once, without saving.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again" — the job saved its state and
# wants to be restarted with `--resume auto`. Launchers (slurm/, sweeps) test for it.
EXIT_PREEMPTED = 75
# Training stopped because too many consecutive steps had a non-finite loss or gradient.
EXIT_NONFINITE = 3
# A bad config, checkpoint or credential: nothing was written (one line on stderr).
EXIT_USAGE = 2
# Aborted by a second Ctrl-C (128 + SIGINT, what shells report for a Ctrl-C'd command).
EXIT_ABORTED = 130

PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionFlag:
    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self.interrupted = False  # a first Ctrl-C was seen
        self.phase = "setup"  # the trainer sets "training" once its first step can start
        self._previous: dict[int, object] = {}

    def _handler(self, signum: int, frame: object) -> None:  # noqa: ARG002
        self.requested = True
        self.signum = signum

    def _interrupt(self, signum: int, frame: object) -> None:
        if self.interrupted:
            raise KeyboardInterrupt  # the second Ctrl-C: abort without saving
        self.interrupted = True
        self._handler(signum, frame)
        if self.phase == "setup":
            os.write(
                2,
                b"interrupted (Ctrl-C) during the setup: stopping before the first step, "
                b"nothing trained or saved; press Ctrl-C again to abort at once\n",
            )
            return
        os.write(
            2,
            b"interrupted (Ctrl-C): saving a checkpoint at the end of this step, "
            b"then exiting; press Ctrl-C again to abort without saving\n",
        )

    def install(self, interrupt: bool = True) -> PreemptionFlag:
        """The handlers (again: a second call keeps the first one's previous handlers);
        `interrupt`: Ctrl-C's too."""
        for sig in PREEMPT_SIGNALS:
            self._previous.setdefault(sig, signal.signal(sig, self._handler))
        if interrupt:
            previous = signal.signal(signal.SIGINT, self._interrupt)
            self._previous.setdefault(signal.SIGINT, previous)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


# The flag `gpn-scale train` installs first (cli.main, before its heavy imports: torch, the
# config): a SIGTERM / SIGUSR1 in the start-up's first seconds is recorded, not fatal, and the
# trainer takes it over (StopConditions): it stops before step 1, writes nothing, exits 75.
_early: PreemptionFlag | None = None


def install_early() -> None:
    """SIGTERM / SIGUSR1 recorded from now on (Ctrl-C keeps its default until the trainer)."""
    global _early
    if _early is None:
        _early = PreemptionFlag().install(interrupt=False)


def release_early() -> None:
    """The end of `gpn-scale train` when no trainer took the early flag (a read-only
    sub-command, a refused config): its handlers go, and a signal it recorded takes its
    default course, as it would have without the flag."""
    global _early
    flag, _early = _early, None
    if flag is not None:
        flag.uninstall()
        if flag.signum is not None:
            signal.raise_signal(flag.signum)


def _take_early(enabled: bool) -> PreemptionFlag | None:
    """The trainer's flag: the early one when installed (a signal it saw is kept), else a
    new one; none when preemption is disabled (a signal seen early then acts as by default)."""
    global _early
    flag, _early = _early, None
    if enabled:
        return (flag or PreemptionFlag()).install()
    if flag is not None:
        _early = flag
        release_early()
    return None


def job_deadline(environ: Mapping[str, str], margin_s: float) -> float | None:
    """When to save and exit (epoch seconds): `margin_s` before SLURM_JOB_END_TIME, or None
    (no end time, an unparsable one, or margin 0). Every rank of a job sees the same value;
    the loop still agrees on the decision with one all-reduce (clocks differ a little)."""
    raw = environ.get("SLURM_JOB_END_TIME", "").strip()
    if margin_s <= 0 or not raw.isdigit() or int(raw) <= 0:
        return None
    return int(raw) - float(margin_s)


def request_slurm_requeue(log=print) -> bool:
    """`scontrol requeue $SLURM_JOB_ID` (rank 0 only); True when the request was accepted."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or not shutil.which("scontrol"):
        log("preemption: not under SLURM (or no scontrol); not requeueing")
        return False
    try:
        subprocess.run(
            ["scontrol", "requeue", job], check=True, capture_output=True, text=True, timeout=30
        )
    except (subprocess.SubprocessError, OSError) as err:
        print(f"preemption: scontrol requeue {job} failed: {err}", file=sys.stderr)
        return False
    log(f"preemption: requeued SLURM job {job}")
    return True


class StopConditions:
    """When a run stops early: a preemption signal or Ctrl-C (the flag, installed from the
    start of the setup to the end of the run), or the job's deadline (SLURM_JOB_END_TIME
    less preemption.end_margin_s); and how it says why."""

    def __init__(self, enabled: bool, end_margin_s: float, requeue: bool) -> None:
        self.flag = _take_early(enabled)
        self.deadline = job_deadline(os.environ, end_margin_s) if enabled else None
        self.margin_s, self.requeue = end_margin_s, requeue
        self.deadline_hit = False

    @classmethod
    def off(cls) -> StopConditions:
        """Nothing to stop on (a trainer before its run): the early flag is left alone."""
        stops = cls.__new__(cls)
        stops.flag, stops.deadline, stops.margin_s = None, None, 0.0
        stops.requeue = stops.deadline_hit = False
        return stops

    def local_request(self) -> bool:
        """This rank's view (the trainer agrees on it over all ranks)."""
        if self.flag is None:
            return False
        local = self.flag.requested
        if self.deadline is not None and time.time() >= self.deadline:
            local = self.deadline_hit = True
        return local

    def training_started(self) -> None:
        if self.flag is not None:
            self.flag.phase = "training"

    def _deadline_words(self) -> str:
        return f"the job's time limit is {self.margin_s:.0f}s away (SLURM_JOB_END_TIME)"

    def why_preempted(self) -> str:
        if self.flag is not None and self.flag.signum:
            return f"signal {self.flag.signum}"
        return self._deadline_words() if self.deadline_hit else "signal on another rank"

    def why_stopped_in_setup(self) -> str:
        if self.flag is not None and self.flag.interrupted:
            return "Ctrl-C"
        if self.flag is not None and self.flag.signum:
            return f"signal {self.flag.signum}"
        return self._deadline_words()

    def requeue_if_preempted(self, is_main: bool, log: Callable[[str], None]) -> None:
        """`scontrol requeue` (rank 0) for a preemption; never for a Ctrl-C."""
        flag = self.flag
        if self.requeue and is_main and flag is not None and not flag.interrupted:
            request_slurm_requeue(log)

    def uninstall(self) -> None:
        if self.flag is not None:
            self.flag.uninstall()
