"""Helpers that `slurm/sweep.sh` and `slurm/train.sbatch` call, so that no YAML is parsed in bash.

    gpn-scale sweep pending SWEEP            the indices of runs without a DONE marker, "0,2,3"
                                             (an empty line when every run is finished)
    gpn-scale sweep run-argv SWEEP INDEX     the `gpn-scale train` arguments of run INDEX, one per
                                             line; with --if-pending nothing (exit 0) when the run
                                             already has its DONE marker

A run is finished when `<checkpoint root>/DONE` exists (local path or s3://, endpoint as
gpn_scale.io resolves it): the trainer writes it last, after the final eval and checkpoint.
Run indices are positions in `expand_sweep(SWEEP)`: stable for a given sweep file, and the
SLURM array task ids of `sweep.sh`.
"""

from __future__ import annotations

from gpn_scale.scaling.sweep import RunSpec, Sweep, SweepError, load_sweep

DONE = "DONE"


def is_done(run: RunSpec) -> bool:
    """True when the run's DONE marker exists beside its checkpoints."""
    from gpn_scale.scaling.collect import _read

    return _read(run.checkpoint_root, DONE) is not None


def pending_indices(sweep: Sweep) -> list[int]:
    return [i for i, run in enumerate(sweep.runs) if not is_done(run)]


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
