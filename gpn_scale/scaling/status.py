"""`gpn-scale sweep status SWEEP`: one row per run of a sweep: state, step, tokens, last eval loss,
restarts.

Where each column comes from (nothing here needs the scheduler, which only refines `state`):
    <checkpoint root>/DONE     finished: step, tokens, final_eval_loss (authoritative)
    <checkpoint root>/latest   the last complete checkpoint's step (S3 or local)
    <run_dir>/metrics.jsonl    last train step/tokens, last eval/loss, and "preempted" events
                               (each one a save + exit 75 + restart = one restart)
    squeue                     PENDING / RUNNING for jobs named `gpn-<sweep>` (the array of
                               `slurm/sweep.sh`, task id = run index) or `gpn-<sweep>.<index>`
                               (one job per run, from `gpn-scale sweep submit --executor slurm`)

States: done | running | queued (from squeue) | preempted (saved and waiting to restart) |
started (has progress but no job seen) | failed (last line a non-finite stop) | not started.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from gpn_scale.io.run_folder import DONE, LATEST, METRICS
from gpn_scale.scaling.sweep import RunSpec, Sweep

JOB_PREFIX = "gpn-"


@dataclass
class RunStatus:
    index: int
    name: str
    state: str
    step: int | None = None
    total_steps: int | None = None
    tokens: int | None = None
    eval_loss: float | None = None
    restarts: int = 0
    job: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def array_job_name(sweep_name: str) -> str:
    return f"{JOB_PREFIX}{sweep_name}"


def single_job_name(sweep_name: str, index: int) -> str:
    return f"{JOB_PREFIX}{sweep_name}.{index}"


def _metrics(run_dir: str | None) -> list[dict]:
    from gpn_scale.train.metrics import read_jsonl

    return read_jsonl(Path(run_dir) / METRICS, live=True) if run_dir else []


def _json_at(uri: str, key: str) -> dict | None:
    from gpn_scale.scaling.collect import json_object, read_at

    return json_object(read_at(uri, key), f"{uri.rstrip('/')}/{key}")


def scheduler_jobs(sweep: Sweep) -> dict[int, tuple[str, str]]:
    """run index -> (SLURM state, job id) for this sweep's jobs still known to squeue."""
    if not shutil.which("squeue"):
        return {}
    names = f"{array_job_name(sweep.name)}," + ",".join(
        single_job_name(sweep.name, i) for i in range(len(sweep.runs))
    )
    try:
        proc = subprocess.run(
            ["squeue", "-h", "--array", "-n", names, "-o", "%j|%K|%T|%i"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (subprocess.SubprocessError, OSError):
        return {}
    if proc.returncode != 0:
        return {}
    jobs: dict[int, tuple[str, str]] = {}
    for line in proc.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4:
            continue
        name, task, state, job = parts
        index = None
        if name == array_job_name(sweep.name) and task.isdigit():
            index = int(task)
        elif name.startswith(array_job_name(sweep.name) + "."):
            tail = name.rsplit(".", 1)[1]
            index = int(tail) if tail.isdigit() else None
        if index is not None and 0 <= index < len(sweep.runs):
            # a RUNNING task wins over a PENDING duplicate
            if index not in jobs or state == "RUNNING":
                jobs[index] = (state, job)
    return jobs


def run_status(index: int, run: RunSpec, job: tuple[str, str] | None = None) -> RunStatus:
    st = RunStatus(index=index, name=run.name, state="not started", total_steps=run.total_steps)
    records = _metrics(run.run_dir)
    st.restarts = sum(1 for r in records if r.get("event") == "preempted")
    for r in records:
        loss = r.get("eval/loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            st.eval_loss = float(loss)
        if "train/loss" in r and isinstance(r.get("step"), int):
            st.step, st.tokens = r["step"], r.get("tokens", st.tokens)
    done = _json_at(run.checkpoint_root, DONE)
    if done is not None:
        st.state = "done"
        st.step = done.get("step", st.step)
        st.tokens = done.get("tokens", st.tokens)
        loss = done.get("final_eval_loss")
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            st.eval_loss = float(loss)
        return st
    if st.step is None:
        latest = _json_at(run.checkpoint_root, LATEST)
        if latest and isinstance(latest.get("step"), int):
            st.step = latest["step"]
            st.tokens = st.step * run.global_batch_size * run.seq_len
    if job is not None:
        state, st.job = job
        st.state = {
            "RUNNING": "running",
            "PENDING": "queued",
            "REQUEUED": "queued",
            "CONFIGURING": "queued",
            "COMPLETING": "running",
        }.get(state, state.lower())
    elif records and records[-1].get("event") == "preempted":
        st.state = "preempted"
    elif records and records[-1].get("event") == "stopped_nonfinite":
        st.state = "failed"
    elif st.step is not None:
        st.state = "started"
    return st


def sweep_status(sweep: Sweep, *, scheduler: bool = True) -> list[RunStatus]:
    jobs = scheduler_jobs(sweep) if scheduler else {}
    return [run_status(i, run, jobs.get(i)) for i, run in enumerate(sweep.runs)]


def format_status(sweep: Sweep, rows: list[RunStatus]) -> str:
    table = [("#", "run", "state", "step", "tokens", "eval loss", "restarts", "job")]
    for r in rows:
        table.append(
            (
                str(r.index),
                r.name,
                r.state,
                "-" if r.step is None else f"{r.step}/{r.total_steps}",
                "-" if r.tokens is None else f"{r.tokens:,}",
                "-" if r.eval_loss is None else f"{r.eval_loss:.4f}",
                str(r.restarts),
                r.job or "-",
            )
        )
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    lines = []
    for i, row in enumerate(table):
        lines.append(
            "  ".join(
                cell.ljust(w) if c in (1, 2) else cell.rjust(w)
                for c, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    lines.append(
        f"sweep {sweep.name}: {len(rows)} runs: "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    )
    return "\n".join(lines)
