"""Run ownership (issue 17): a second trainer on a run another job is training refuses in one
line (exit 2) and writes nothing; once the owner is gone (kill -9), its lease is stale and
the run continues. Issue 36: a trainer whose run was taken over stops in one line, and a
start that lost the lease removes none of the winner's folders."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from train_helpers import child_env, kill9, run_train, start_train, train_losses, wait_for_step

from gpn_scale.checkpoint import CheckpointManager
from gpn_scale.checkpoint.lease import LeaseHeld, RunLease, read_lease
from gpn_scale.io.run_folder import missing_tops
from gpn_scale.io.storage import open_storage
from gpn_scale.run.config import load_train_config
from gpn_scale.train.checkpointing import RunCheckpoints
from gpn_scale.train.loop import Trainer

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


def test_a_trainer_whose_run_was_taken_over_stops_in_one_line(corpus, tmp_path):
    """Issue 36 case 13: a trainer whose lease was taken with --take-over trained and saved on:
    two writers on one root. It stops within a step or two of the take-over, exit 2, one
    line naming the new owner, and writes no checkpoint after it (one already being written
    at that moment at most) nor the lease."""
    run_dir = tmp_path / "run"
    over = (
        "schedule.total_steps=40",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=50",
        "debug.step_sleep=0.5",
        "checkpoint.lease_ttl_s=2",  # its heartbeat thread looks every 0.4 s
    )
    first = start_train(corpus, run_dir, *over, env=child_env(tmp_path, SLURM_JOB_ID="101"))
    try:
        wait_for_step(first, run_dir, 2)
        root = open_storage(str(run_dir / "checkpoints"))
        taker = RunLease(root, ttl_s=600, owner="slurm-job-202")  # as `train --take-over` does
        assert "took the run over from slurm-job-101" in taker.acquire(take_over=True)
        before = set(root.list_dirs())
        started = time.time()
        out, _ = first.communicate(timeout=120)
        stopped_after = time.time() - started
    finally:
        if first.poll() is None:
            kill9(first)
    errors = [line for line in out.splitlines() if line.startswith("gpn-scale: error:")]
    assert first.returncode == 2, out[-3000:]
    assert len(errors) == 1 and "taken over by slurm-job-202" in errors[0], out[-3000:]
    assert "Traceback" not in out
    assert stopped_after < 15, stopped_after  # steps of 0.5 s: not the 19 s left to train
    assert len(set(root.list_dirs()) - before) <= 1, sorted(root.list_dirs())
    assert read_lease(root)["owner"] == "slurm-job-202"
    taker.release()


def _checkpoints(cfg, run_dir: Path) -> RunCheckpoints:  # type: ignore[no-untyped-def]
    topo = SimpleNamespace(is_main=True, all_reduce_max=lambda value: value)
    mgr = CheckpointManager(cfg.resolved_checkpoint_root)
    return RunCheckpoints(
        cfg, topo, mgr, print, strategy="none", run_dir=str(run_dir), resume="auto",
        eval_only=False, fresh=False, take_over=False,
    )  # fmt: skip


def test_a_start_that_loses_the_lease_removes_nothing_the_winner_uses(tmp_path: Path) -> None:
    """Issue 36 case 2: two trainers on a new run_dir both found it missing; the loser's
    failed-start cleanup deleted it under the winner, which died. A start that finds another
    job's lease removes nothing; once nobody holds the run it removes what it created."""
    run_dir = tmp_path / "run"
    cfg = load_train_config("ci_tiny", [f"run_dir={run_dir}"])
    loser = Trainer(cfg)
    # as the loser's run() found them, before the winner made them
    loser._new_dirs = missing_tops([str(run_dir), cfg.resolved_checkpoint_root])
    winner_mgr = CheckpointManager(cfg.resolved_checkpoint_root)
    winner_mgr.preflight()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    winner = RunLease(winner_mgr.storage, ttl_s=60, owner="the-winner")
    winner.acquire()
    try:
        loser.ckpt = _checkpoints(cfg, run_dir)
        with pytest.raises(LeaseHeld, match="the-winner"):
            loser.ckpt.take_lease()
        loser._remove_new_dirs()  # what run() does on a ConfigError before training
        assert (run_dir / "metrics.jsonl").is_file()
        assert read_lease(winner_mgr.storage)["owner"] == "the-winner"
    finally:
        winner.release()
    loser.ckpt = _checkpoints(cfg, run_dir)
    loser._remove_new_dirs()
    assert not run_dir.exists()
