"""Preemption: a signal only sets a flag; the loop acts on it at the next step boundary.

SIGUSR1 (what SLURM sends with `--signal=USR1@<secs>` before the time limit) and SIGTERM
(what SLURM / Kubernetes / spot reclaimers send before killing) set `PreemptionFlag.requested`.
At the end of every step all ranks agree on the flag (an all-reduce MAX, so one rank's signal
stops everyone at the same step), save a checkpoint and exit with EXIT_PREEMPTED.
Doing nothing else in the handler keeps it safe: no I/O or collectives from signal context.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again" — the job saved its state and
# wants to be restarted with `--resume auto`. Launchers (slurm/, sweeps) test for it.
EXIT_PREEMPTED = 75
# Training stopped because too many consecutive steps had a non-finite loss or gradient.
EXIT_NONFINITE = 3
# A bad config, checkpoint or credential: nothing was written (one line on stderr).
EXIT_USAGE = 2

PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionFlag:
    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handler(self, signum: int, frame: object) -> None:  # noqa: ARG002
        self.requested = True
        self.signum = signum

    def install(self) -> PreemptionFlag:
        for sig in PREEMPT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


def request_slurm_requeue(log=print) -> bool:
    """`scontrol requeue $SLURM_JOB_ID` (rank 0 only); True when the request was accepted."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or not shutil.which("scontrol"):
        log("preemption: not under SLURM (or no scontrol); not requeueing")
        return False
    try:
        subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True,
                       text=True, timeout=30)
    except (subprocess.SubprocessError, OSError) as err:
        print(f"preemption: scontrol requeue {job} failed: {err}", file=sys.stderr)
        return False
    log(f"preemption: requeued SLURM job {job}")
    return True
