"""Exact resume: kill -9 / SIGUSR1 mid-run, `--resume auto`, per-step losses equal (==) to
an uninterrupted run. Real subprocesses of `python -m gpn_scale train`, real signals."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from train_helpers import (
    child_env,
    kill9,
    read_metrics,
    run_train,
    start_train,
    train_losses,
    wait_for_step,
)

pytestmark = pytest.mark.slow

TOTAL = 8
# Checkpoint every 2 steps; the interrupted run sleeps a little after each step so that
# the test can hit it between checkpoints.
COMMON = (f"schedule.total_steps={TOTAL}", "checkpoint.every_steps=2", "checkpoint.keep_last=2")
SLOW = ("debug.step_sleep=0.4",)


# Every registered family's tiny config (models/registry.py); "tiny" is GPN+M.
FAMILY_MODELS = ["tiny", "transformer_pp_tiny", "gated_deltanet_tiny"]


@pytest.fixture(scope="module")
def references(corpus: str, once_per_run):
    """model -> the uninterrupted run's per-step losses (each run once per test run)."""

    def get(model: str = "tiny") -> dict[int, float]:
        def build(base: Path) -> None:
            run_train(corpus, base / "run", *COMMON, f"model={model}")

        losses = train_losses(once_per_run(f"resume_reference_{model}", build) / "run")
        assert sorted(losses) == list(range(1, TOTAL + 1))
        return losses

    return get


@pytest.fixture(scope="module")
def reference(references) -> dict[int, float]:
    return references("tiny")


def _interrupt_and_resume(
    corpus: str,
    run_dir: Path,
    reference: dict[int, float],
    extra: tuple[str, ...] = (),
    env: dict | None = None,
) -> None:
    proc = start_train(corpus, run_dir, *COMMON, *extra, *SLOW, env=env)
    seen = wait_for_step(proc, run_dir, 5)
    kill9(proc)
    assert proc.returncode == -signal.SIGKILL
    assert seen < TOTAL
    run_train(corpus, run_dir, *COMMON, *extra, resume="auto", env=env)
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, TOTAL + 1))  # no step lost, none doubled
    assert losses == reference  # bit-identical continuation
    done = [r for r in read_metrics(run_dir) if r.get("event") == "checkpoint"]
    assert done, "the resumed run wrote checkpoints"


@pytest.mark.parametrize("model", FAMILY_MODELS)
def test_kill9_then_resume_auto_local(corpus, references, tmp_path, model):
    run_dir = tmp_path / "run"
    _interrupt_and_resume(corpus, run_dir, references(model), extra=(f"model={model}",))
    marker = json.loads((run_dir / "checkpoints" / "DONE").read_text())
    assert marker["step"] == TOTAL and marker["tokens"] == TOTAL * 4 * 64
    assert marker["final_eval_loss"] > 0 and marker["params"] > 0 and marker["flops"] > 0
    assert (run_dir / "config.yaml").exists()


def test_kill9_then_resume_auto_s3(corpus, reference, tmp_path, s3_bucket):
    import boto3

    root = f"{s3_bucket}/runs/r1/ckpt"
    run_dir = tmp_path / "run"
    _interrupt_and_resume(
        corpus, run_dir, reference, extra=(f"checkpoint.root={root}",), env=child_env(tmp_path)
    )
    s3 = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
    bucket = s3_bucket.removeprefix("s3://")
    done = json.loads(s3.get_object(Bucket=bucket, Key="runs/r1/ckpt/DONE")["Body"].read())
    assert done["step"] == TOTAL
    assert not (run_dir / "checkpoints").exists()  # nothing went to the local default


def test_sigusr1_saves_exits_75_and_resumes(corpus, reference, tmp_path):
    from gpn_scale.train.signals import EXIT_PREEMPTED

    run_dir = tmp_path / "run"
    proc = start_train(corpus, run_dir, *COMMON, *SLOW)
    wait_for_step(proc, run_dir, 3)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED == 75, out[-2000:]
    events = [r for r in read_metrics(run_dir) if r.get("event")]
    pre = [r for r in events if r["event"] == "preempted"]
    assert len(pre) == 1
    stopped = pre[0]["step"]
    assert 3 <= stopped < TOTAL
    saved = [r for r in events if r["event"] == "checkpoint" and r["step"] == stopped]
    assert saved, f"no checkpoint at the preemption step {stopped}: {events}"
    assert max(train_losses(run_dir)) == stopped
    run_train(corpus, run_dir, *COMMON, resume="auto")
    assert train_losses(run_dir) == reference


def test_kill9_of_the_whole_job_then_immediate_restart(corpus, reference, tmp_path):
    """SIGKILL to the trainer's whole process group (its multiprocessing resource tracker
    too, as under SLURM or torchrun), restart at once: the dead run's shared memory is
    still in /dev/shm, young, and mapped by the restarted job's own prefix scan. It must be
    recognised as dead by its owner's PID (it was refused as "in use by another running
    loader" until it was 30 s old)."""
    run_dir = tmp_path / "run"
    proc = start_train(corpus, run_dir, *COMMON, *SLOW, new_session=True)
    wait_for_step(proc, run_dir, 3)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    left = [p.name for p in Path("/dev/shm").iterdir() if p.name[:6].isdigit()]
    assert left, "the killed job left no shared memory behind (this test would prove nothing)"
    run_train(corpus, run_dir, *COMMON, resume="auto")
    assert train_losses(run_dir) == reference
