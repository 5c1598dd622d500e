"""Run ownership (issue 17): a second trainer on a run another job is training refuses in one
line (exit 2) and writes nothing; once the owner is gone (kill -9), its lease is stale and
the run continues."""

from __future__ import annotations

import json

import pytest
from train_helpers import child_env, kill9, run_train, start_train, train_losses, wait_for_step

pytestmark = pytest.mark.slow


def test_second_job_on_a_leased_run_refuses_in_one_line(corpus, tmp_path):
    run_dir = tmp_path / "run"
    over = ("schedule.total_steps=30", "checkpoint.every_steps=1", "debug.step_sleep=1")
    first = start_train(corpus, run_dir, *over, env=child_env(tmp_path, SLURM_JOB_ID="101"))
    try:
        wait_for_step(first, run_dir, 1)
        lease = json.loads((run_dir / "checkpoints" / "LEASE").read_text())
        assert lease["owner"] == "slurm-job-101" and lease["ttl_s"] == 300
        second = run_train(
            corpus,
            run_dir,
            *over,
            resume="auto",
            check=False,
            env=child_env(tmp_path, SLURM_JOB_ID="202"),
        )
        assert second.returncode == 2
        err = second.stderr.strip().splitlines()
        assert len(err) == 1 and "slurm-job-101" in err[0] and "--take-over" in err[0], err
        assert first.poll() is None  # the owner trains on, untouched
    finally:
        kill9(first)
    # the owner died without releasing: its lease (same host, pid gone) is stale
    proc = run_train(
        corpus,
        run_dir,
        *over,
        "debug.step_sleep=0",
        resume="auto",
        env=child_env(tmp_path, SLURM_JOB_ID="303"),
    )
    assert "replaced the stale lease of slurm-job-101" in proc.stdout
    assert sorted(train_losses(run_dir)) == list(range(1, 31))
    assert not (run_dir / "checkpoints" / "LEASE").exists()  # released at the end
