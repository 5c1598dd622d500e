"""`gpn-scale sweep submit SWEEP`: the Python alternative to `sbatch slurm/sweep.sh SWEEP`.

One submitit job per unfinished run (no DONE marker beside its checkpoints), each running
`gpn-scale train <run argv> --resume auto` in a child process:

    --executor slurm   submitit's SLURM executor: N nodes x G tasks per node (one per GPU);
                       the trainer finds rank/world from SLURM_PROCID/SLURM_NTASKS. On the time
                       limit or a preemption submitit signals the job (USR2, `signal_delay_s`
                       before the end) and calls `TrainRun.checkpoint`, which sends USR1 to the
                       trainer, waits for its save (exit 75), and hands submitit the same run
                       to requeue; the requeued job resumes from the latest checkpoint.
    --executor local   submitit's local executor (a laptop): the runs start at once as local
                       processes, one task each.
    --executor auto    slurm when `sbatch` is on PATH, else local.

Jobs are named `gpn-<sweep>.<index>` (what `gpn-scale sweep status` looks for in squeue);
submitit's logs and pickles go to --folder (default <run_root or .>/submitit).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpn_scale.scaling.slurm_launch import pending_indices
from gpn_scale.scaling.status import single_job_name
from gpn_scale.scaling.sweep import Sweep, SweepError

EXIT_PREEMPTED = 75
# submitit's default (3) ends a run at its 4th time limit; a long run is requeued many times.
MAX_NUM_TIMEOUT = 1000


def _ignore_usr2() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class TrainRun:
    """A picklable job: run the trainer for one sweep run, resuming from its checkpoints."""

    def __init__(self, argv: list[str], python: str | None = None, grace_s: float = 600.0):
        self.argv = list(argv)
        self.python = python or sys.executable
        self.grace_s = grace_s
        self._proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        # the launcher requeues (submitit), never the trainer itself
        return [
            self.python,
            "-m",
            "gpn_scale.cli",
            "train",
            *self.argv,
            "preemption.requeue=false",
            "--resume",
            "auto",
        ]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_proc"] = None
        return state

    @staticmethod
    def child_env(environ: dict[str, str] | None = None) -> dict[str, str]:
        """The trainer's environment: under SLURM without MASTER_ADDR/MASTER_PORT, which sbatch
        copied from the submitting shell (a stale rendezvous of an earlier job); the trainer
        derives both from the job (first node, a port from the job id)."""
        env = dict(os.environ if environ is None else environ)
        if env.get("SLURM_JOB_ID") and "RANK" not in env:
            env.pop("MASTER_ADDR", None)
            env.pop("MASTER_PORT", None)
        return env

    def __call__(self) -> int:
        # SLURM delivers submitit's USR2 (`--signal=USR2@delay`, no B:) to every process of the
        # step; the trainer must not die of it (USR2's default action) but save on the USR1
        # that `checkpoint` sends. Its helpers inherit the ignore as well.
        self._proc = subprocess.Popen(self.command(), preexec_fn=_ignore_usr2, env=self.child_env())
        # Poll rather than block in Popen.wait(): a blocking wait holds Popen's waitpid lock,
        # and submitit's signal handler (-> checkpoint) runs inside it and must reap the child.
        while (rc := self._proc.poll()) is None:
            time.sleep(0.5)
        if rc == EXIT_PREEMPTED:
            job = os.environ.get("SLURM_JOB_ID")
            if job and shutil.which("scontrol"):
                # preempted without submitit's own signal (SLURM's preemption SIGTERM): requeue
                # the same submission as submitit does for its USR2 (the requeued job resumes
                # from the checkpoint) and end without a result, so the job is not FAILED
                if os.environ.get("SLURM_PROCID", "0") == "0":
                    subprocess.run(["scontrol", "requeue", job], check=False, timeout=60)
                sys.stdout.flush()
                os._exit(0)
            raise RuntimeError(
                f"trainer was preempted (exit {rc}); checkpoint saved, resubmit to continue"
            )
        if rc != 0:
            raise RuntimeError(f"`gpn-scale train` exited {rc}")
        return rc

    def checkpoint(self, *args, **kwargs):
        """Called by submitit on timeout/preemption: let the trainer save, then requeue."""
        import submitit

        proc = self._proc
        if proc is not None and proc.returncode is None:
            # os-level calls only: this runs in a signal handler, possibly inside Popen.poll()
            os.kill(proc.pid, signal.SIGUSR1)
            deadline = time.monotonic() + self.grace_s
            while True:
                try:
                    pid, _ = os.waitpid(proc.pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid:
                    break
                if time.monotonic() > deadline:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.2)
        return submitit.helpers.DelayedSubmission(TrainRun(self.argv, self.python, self.grace_s))


@dataclass
class SubmitOptions:
    executor: str = "auto"  # auto | slurm | local
    folder: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = 24 * 60
    nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU (one task per node)
    cpus_per_task: int | None = None
    mem_gb: float | None = None
    signal_delay_s: int = 300
    only: list[int] | None = None  # submit only these run indices (if unfinished)


def resolve_executor(kind: str) -> str:
    if kind not in ("auto", "slurm", "local"):
        raise SweepError(f"--executor: one of auto, slurm, local; got {kind!r}")
    if kind == "auto":
        return "slurm" if shutil.which("sbatch") else "local"
    if kind == "slurm" and not shutil.which("sbatch"):
        raise SweepError(
            "--executor slurm: no sbatch on PATH; run on a SLURM login node, set "
            "PATH (and SLURM_CONF), or use --executor local"
        )
    return kind


def make_executor(sweep: Sweep, opts: SubmitOptions):
    import submitit

    kind = resolve_executor(opts.executor)
    folder = opts.folder or str(Path(sweep.runs[0].run_dir or ".").parent / "submitit")
    ex = submitit.AutoExecutor(
        folder=str(Path(folder) / "%j"), cluster=kind, slurm_max_num_timeout=MAX_NUM_TIMEOUT
    )
    tasks = max(1, opts.gpus_per_node)
    params: dict[str, Any] = dict(timeout_min=opts.time_min, nodes=opts.nodes, tasks_per_node=tasks)
    if opts.cpus_per_task:
        params["cpus_per_task"] = opts.cpus_per_task
    if opts.gpus_per_node:
        params["gpus_per_node"] = opts.gpus_per_node
    if opts.mem_gb:
        params["mem_gb"] = opts.mem_gb
    if kind == "slurm":
        params["slurm_signal_delay_s"] = opts.signal_delay_s
        for key, value in (
            ("slurm_partition", opts.partition),
            ("slurm_account", opts.account),
            ("slurm_qos", opts.qos),
        ):
            if value:
                params[key] = value
    elif opts.nodes != 1:
        raise SweepError("--nodes: the local executor runs on this machine only; use --nodes 1")
    ex.update_parameters(**params)
    return kind, ex


def submit_sweep(sweep: Sweep, opts: SubmitOptions) -> tuple[str, list[tuple[int, Any]]]:
    """Submit every unfinished run (or the unfinished ones of `opts.only`); returns the
    executor kind and [(run index, submitit job)]."""
    n = len(sweep.runs)
    for i in opts.only or []:
        if not 0 <= i < n:
            raise SweepError(
                f"--only: run index {i} out of range: sweep '{sweep.name}' has {n} runs (0-{n - 1})"
            )
    todo = pending_indices(sweep)
    if opts.only is not None:
        todo = [i for i in todo if i in set(opts.only)]
    kind, ex = make_executor(sweep, opts)
    jobs: list[tuple[int, Any]] = []
    python = os.environ.get("GPN_SCALE_PYTHON") or sys.executable
    for i in todo:
        ex.update_parameters(name=single_job_name(sweep.name, i))
        try:
            job = ex.submit(
                TrainRun(
                    sweep.runs[i].train_argv(), python, grace_s=max(30, opts.signal_delay_s - 30)
                )
            )
        except Exception as err:  # noqa: BLE001 - sbatch's own message, on one line
            lines = [ln for ln in str(err).splitlines() if ln.strip()]
            raise SweepError(
                f"submitting run {i} ({sweep.runs[i].name}) to {kind} failed"
                + (f" after {len(jobs)} submitted" if jobs else "")
                + f": {lines[-1].strip() if lines else type(err).__name__}"
            ) from None
        jobs.append((i, job))
    return kind, jobs
