"""Helpers that `slurm/sweep.sh` and `slurm/train.sbatch` call, so that no YAML is parsed in bash.

    gpn-scale sweep pending SWEEP            the indices of runs without a DONE marker and
                                             without a live job, "0,2,3" (an empty line when
                                             none is left to submit)
    gpn-scale sweep run-argv SWEEP INDEX     the `gpn-scale train` arguments of run INDEX, one per
                                             line; with --if-pending nothing (exit 0) when the run
                                             already has its DONE marker

    gpn-scale sweep snapshot SWEEP OUT.json  the argv table of every run, frozen at submit time:
                                             sweep.sh hands it (not the YAML) to the array
                                             tasks, so an edit or `git pull` of the sweep file
                                             never remaps a queued task's index

`run-argv` takes either a sweep YAML or such a table.

A run is finished when `<checkpoint root>/DONE` exists (local path or s3://, endpoint as
gpn_scale.io resolves it): the trainer writes it last, after the final eval and checkpoint.
Run indices are positions in `expand_sweep(SWEEP)`: stable for a given sweep file, and the
SLURM array task ids of `sweep.sh`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpn_scale.io.run_folder import DONE
from gpn_scale.scaling.sweep import RunSpec, Sweep, SweepError, load_sweep


def is_done(run: RunSpec | TableRun) -> bool:
    """True when the run's DONE marker exists beside its checkpoints."""
    from gpn_scale.scaling.collect import read_at

    return read_at(run.checkpoint_root, DONE) is not None


class TableRun:
    """One row of a snapshot table: what an array task needs (RunSpec's interface subset)."""

    def __init__(self, row: dict) -> None:
        self.name: str = row["name"]
        self.checkpoint_root: str = row["checkpoint_root"]
        self._argv: list[str] = list(row["argv"])

    def train_argv(self) -> list[str]:
        return list(self._argv)


def write_table(sweep: Sweep, out: str) -> None:
    rows = [
        {"index": i, "name": r.name, "checkpoint_root": r.checkpoint_root, "argv": r.train_argv()}
        for i, r in enumerate(sweep.runs)
    ]
    table = {"sweep": sweep.name, "source": str(sweep.path), "created": time.time(), "runs": rows}
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1))
    tmp.replace(path)  # a task never reads half a table


def table_run_at(path: str, index: int) -> TableRun:
    try:
        table = json.loads(Path(path).read_text())
        rows = table["runs"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SweepError(
            f"{path}: not a sweep argv table ({type(err).__name__}: {err}); it is written by "
            "`gpn-scale sweep snapshot` (slurm/sweep.sh)"
        ) from None
    if not 0 <= index < len(rows):
        raise SweepError(f"run index {index} out of range: {path} has {len(rows)} runs")
    return TableRun(rows[index])


def live_runs(sweep: Sweep) -> dict[int, str]:
    """run index -> why it has a live job: one in squeue (queued, running, requeued), or a
    live lease in its checkpoint root (a job this scheduler does not show: another cluster,
    another sweep name, a hand-started run)."""
    from gpn_scale.checkpoint.lease import describe, is_live, read_lease
    from gpn_scale.io.storage import open_storage
    from gpn_scale.scaling.status import scheduler_jobs

    live = {i: f"job {job} is {state}" for i, (state, job) in scheduler_jobs(sweep).items()}
    for i, run in enumerate(sweep.runs):
        if i in live:
            continue
        try:
            lease = read_lease(open_storage(run.checkpoint_root))
        except Exception:  # noqa: BLE001 - an unreadable root is judged by the trainer
            continue
        if lease is not None and is_live(lease):
            live[i] = f"leased by {describe(lease)}"
    return live


def pending_indices(sweep: Sweep, live: dict[int, str] | None = None) -> list[int]:
    """Runs to submit: no DONE marker and no live job (`live`, default `live_runs`)."""
    live = live_runs(sweep) if live is None else live
    return [i for i, run in enumerate(sweep.runs) if i not in live and not is_done(run)]


def run_at(sweep: Sweep, index: int) -> RunSpec:
    n = len(sweep.runs)
    if not 0 <= index < n:
        raise SweepError(
            f"run index {index} out of range: sweep '{sweep.name}' has {n} runs "
            f"(0-{n - 1}); see `gpn-scale sweep plan {sweep.path}`"
        )
    return sweep.runs[index]


def load(path: str) -> Sweep:
    # The file decides about few seeds (allow_few_seeds); launchers never override it.
    return load_sweep(path, price=False)
