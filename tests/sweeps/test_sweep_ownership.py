"""Run ownership on a real local SLURM cluster (issue 17): re-running `slurm/sweep.sh` while a
run's task is running (or queued) submits nothing for it, and the array tasks read the argv
table frozen at submit time, so an edit of the sweep YAML that reorders its runs remaps no
queued task."""

from __future__ import annotations

import subprocess

import pytest
from sweep_helpers import REPO, job_env, wait_for, write_sweep

from gpn_scale.scaling.slurm_launch import load

pytestmark = pytest.mark.slow

SWEEP_SH = REPO / "slurm" / "sweep.sh"


def _run(cmd, env, timeout=180):
    return subprocess.run(
        [str(c) for c in cmd], env=env, cwd=REPO, text=True, capture_output=True, timeout=timeout
    )


def _tasks(env, name):
    out = _run(["squeue", "-h", "-r", "-n", name, "-o", "%K %T"], env).stdout.split("\n")
    return {int(t): s for t, s in (line.split() for line in out if line.strip())}


def test_rerun_while_running_submits_nothing_and_edits_do_not_remap(
    slurm_env, tmp_path, default_corpus
):
    sweep = write_sweep(
        tmp_path / "own.yaml",
        remote=default_corpus,
        name="own",
        checkpoint_root=str(tmp_path / "ckpt"),
        run_root=tmp_path / "runs",
        models=[{"config": "tiny"}],
        overrides=["debug.step_sleep=0.3"],
    )
    env = job_env(
        {
            "SWEEP_GPUS": "0",
            "GPN_NPROC_PER_NODE": "1",
            "SWEEP_CONCURRENCY": "1",
            "SWEEP_CPUS": "1",
            "SWEEP_TIME": "00:10:00",
            "SWEEP_LOG_DIR": str(tmp_path / "logs"),
            "OMP_NUM_THREADS": "1",
        }
    )
    first = _run(["bash", SWEEP_SH, sweep], env)
    assert first.returncode == 0 and "ARRAY_JOB_ID=" in first.stdout, first.stderr
    tables = list((tmp_path / "logs").glob("gpn-own-*.argv.json"))
    assert len(tables) == 1
    wait_for(lambda: _tasks(env, "gpn-own").get(0) == "RUNNING", 300, "task 0 to run")

    # reorder the runs in the YAML (seed 1 first), then submit again while the array lives
    sweep.write_text(sweep.read_text().replace("- 0\n- 1\n", "- 1\n- 0\n"))
    assert load(str(sweep)).runs[0].seed == 1
    again = _run(["bash", SWEEP_SH, sweep], env)
    assert again.returncode == 0, again.stderr
    assert "nothing to submit" in again.stdout and "ARRAY_JOB_ID" not in again.stdout
    assert "skipping run 0" in again.stderr and "is RUNNING" in again.stderr, again.stderr

    wait_for(lambda: not _tasks(env, "gpn-own"), 600, "the array to finish")
    # both runs trained, each with its own seed: no task was remapped onto the other run
    for seed in (0, 1):
        run_dir = tmp_path / "runs" / f"own-tiny-s{seed}"
        assert (tmp_path / "ckpt" / f"own-tiny-s{seed}" / "DONE").exists(), seed
        assert f"seed: {seed}\n" in (run_dir / "config.yaml").read_text()
