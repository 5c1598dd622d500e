"""Preemption in every window of a run (issue 17): the handler stays installed through the
final eval, save and DONE; the preemption save comes before a scheduled eval; the job's
wall-clock end (SLURM_JOB_END_TIME) makes the trainer save and exit 75 on its own."""

from __future__ import annotations

import signal
import time

import pytest
from train_helpers import (
    child_env,
    read_metrics,
    run_train,
    start_train,
    train_losses,
    wait_for_step,
)

from gpn_scale.train.signals import EXIT_PREEMPTED

pytestmark = pytest.mark.slow


def _saved_steps(run_dir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if r.get("event") == "checkpoint"]


def test_usr1_during_the_final_eval_still_leaves_a_resumable_checkpoint(corpus, tmp_path):
    run_dir = tmp_path / "run"
    over = ("schedule.total_steps=4", "checkpoint.every_steps=0", "debug.eval_sleep=3")
    proc = start_train(corpus, run_dir, *over)
    wait_for_step(proc, run_dir, 4)  # the last step is logged: the final eval sleeps now
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=120)
    # Finished (the signal landed in the eval: save + DONE follow at once) or, had it landed
    # before the loop's last check, saved and exited 75; never killed by the signal.
    assert proc.returncode in (0, EXIT_PREEMPTED), out[-2000:]
    assert _saved_steps(run_dir) == [4], out[-2000:]
    if proc.returncode == 0:
        assert (run_dir / "checkpoints" / "DONE").exists()
    run_train(corpus, run_dir, *over, resume="auto")
    assert (run_dir / "checkpoints" / "DONE").exists()


def test_preemption_saves_before_a_scheduled_eval(corpus, tmp_path):
    run_dir = tmp_path / "run"
    over = ("schedule.total_steps=8", "eval.every_steps=1", "debug.step_sleep=0.5")
    proc = start_train(corpus, run_dir, *over)
    wait_for_step(proc, run_dir, 2)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, out[-2000:]
    records = read_metrics(run_dir)
    stopped = [r["step"] for r in records if r.get("event") == "preempted"]
    assert len(stopped) == 1
    evals = {r["step"] for r in records if "eval/loss" in r}
    assert stopped[0] not in evals and evals, (stopped, evals)  # the grace went to the save
    assert _saved_steps(run_dir)[-1] == stopped[0]


def test_job_end_time_makes_the_trainer_save_and_exit_75(corpus, tmp_path):
    run_dir = tmp_path / "run"
    over = ("schedule.total_steps=6", "checkpoint.every_steps=0")
    # the limit is 100 s away, the margin 1000 s: past the deadline already in the setup, so
    # the trainer stops before step 1 (a step trained only to be saved is one nobody asked
    # for), saves nothing, names the cause and exits 75 for the requeue
    env = child_env(tmp_path, SLURM_JOB_END_TIME=str(int(time.time()) + 100))
    proc = run_train(corpus, run_dir, *over, "preemption.end_margin_s=1000", env=env, check=False)
    assert proc.returncode == EXIT_PREEMPTED, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "SLURM_JOB_END_TIME" in proc.stdout + proc.stderr
    assert not (run_dir / "metrics.jsonl").exists() or _saved_steps(run_dir) == []
    run_train(corpus, run_dir, *over, resume="auto")  # no end time: runs to the end
    assert sorted(train_losses(run_dir)) == list(range(1, 7))
