"""`gpn-scale sweep submit` through submitit: the local executor (a laptop) and the SLURM
executor (the local cluster), then `gpn-scale sweep status` and a re-submit that skips
finished runs. A 2-size x 1-seed slice of the CI sweep keeps it short."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from sweep_helpers import REPO, job_env, losses, wait_for, write_sweep

pytestmark = pytest.mark.slow


def _gpn(args, env, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "gpn_scale.cli", *map(str, args)],
        env=env,
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def _sweep(tmp_path, checkpoint_root, remote=None):
    return write_sweep(
        tmp_path / "sub.yaml",
        remote=remote,
        checkpoint_root=checkpoint_root,
        run_root=tmp_path / "runs",
        seeds=[0],
        name="subci",
        models=[{"config": "tiny"}, {"config": "tiny_2l"}],
        tokens=2048,
        overrides=["logging.wandb.mode=offline"],
    )


def _check_finished(sweep, env, restarts=(0, 0)):
    status = json.loads(_gpn(["sweep", "status", sweep, "--json"], env).stdout)["runs"]
    assert [r["state"] for r in status] == ["done", "done"], status
    assert all(r["step"] == r["total_steps"] and r["eval_loss"] > 0 for r in status), status
    assert [r["restarts"] for r in status] == list(restarts), status
    again = _gpn(["sweep", "submit", sweep, "--executor", "local"], env)
    assert again.returncode == 0 and "nothing to submit" in again.stdout, again.stderr
    return status


def test_submit_local_executor(tmp_path, default_corpus):
    sweep = _sweep(tmp_path, str(tmp_path / "ckpt"), default_corpus)
    env = job_env()
    env.pop("SLURM_JOB_ID", None)
    proc = _gpn(
        [
            "sweep",
            "submit",
            sweep,
            "--executor",
            "local",
            "--wait",
            "--folder",
            tmp_path / "submitit",
        ],
        env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("as local job") == 2 and "all 2 jobs finished" in proc.stdout
    _check_finished(sweep, env)
    for name in ("subci-tiny-s0", "subci-tiny_2l-s0"):
        assert sorted(losses(tmp_path / "runs" / name)) == list(range(1, 9))
        assert (tmp_path / "ckpt" / name / "DONE").is_file()


def test_submit_slurm_executor_with_preemption(slurm_env, s3_endpoint, tmp_path, default_corpus):
    bucket = s3_endpoint.create_bucket("subci-slurm")
    sweep = write_sweep(
        tmp_path / "sub.yaml",
        remote=default_corpus,
        checkpoint_root=f"{bucket}/ckpt",
        run_root=tmp_path / "runs",
        seeds=[0],
        name="subci",
        models=[{"config": "tiny"}, {"config": "tiny_2l"}],
        tokens=2048,
        overrides=["logging.wandb.mode=offline", "debug.step_sleep=0.4"],
    )
    env = job_env()
    proc = _gpn(
        [
            "sweep",
            "submit",
            sweep,
            "--executor",
            "slurm",
            "--time-min",
            "10",
            "--cpus-per-task",
            "1",
            "--folder",
            tmp_path / "submitit",
        ],
        env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = [line.rsplit(" ", 1)[1] for line in proc.stdout.splitlines() if "slurm job" in line]
    assert len(jobs) == 2
    # while they are queued or running, status shows their SLURM jobs
    table = _gpn(["sweep", "status", sweep], env).stdout
    assert any(j in table for j in jobs), table
    # preempt run 0 the way submitit expects (USR2 to the job step, as --signal=USR2@delay
    # does): TrainRun.checkpoint lets the trainer save, submitit requeues, the job resumes
    run0 = tmp_path / "runs" / "subci-tiny-s0"

    def progressed():
        try:
            return 2 <= max(losses(run0), default=0) <= 5
        except (OSError, json.JSONDecodeError):
            return False

    wait_for(progressed, 300, "run 0 to reach step 2")
    sig = subprocess.run(
        ["scancel", "--signal=USR2", jobs[0]], env=env, text=True, capture_output=True, timeout=30
    )
    assert sig.returncode == 0, sig.stderr
    for j in jobs:
        assert slurm_env.wait(j, timeout=600) == "COMPLETED", [
            p.read_text()[-2000:] for p in (tmp_path / "submitit").rglob("*.err")
        ]
    status = _check_finished(sweep, env, restarts=[1, 0])
    table = _gpn(["sweep", "status", sweep], env).stdout
    assert "2 done" in table and "subci-tiny-s0" in table, table
    assert sorted(losses(run0)) == list(range(1, status[0]["total_steps"] + 1))
    logs = "".join(p.read_text() for p in (tmp_path / "submitit").rglob(f"{jobs[0]}_*.err"))
    assert "Caught signal SIGUSR2" in logs and "preempted" in logs, logs[-3000:]


def test_submit_errors_are_one_line(tmp_path, monkeypatch):
    sweep = _sweep(tmp_path, str(tmp_path / "ckpt"))
    env = job_env()
    bin_dir = tmp_path / "bin"  # a PATH with python and the basic tools but no SLURM
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "tr", "wc", "grep", "sed", "cat", "date", "mkdir"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env["PATH"] = f"{sys.executable.rsplit('/', 1)[0]}:{bin_dir}"
    proc = _gpn(["sweep", "submit", sweep, "--executor", "slurm"], env)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no sbatch on PATH" in proc.stderr
    proc = _gpn(["sweep", "submit", tmp_path / "nope.yaml"], env)
    assert proc.returncode == 2 and "sweep file not found" in proc.stderr
    proc = _gpn(["sweep", "run-argv", sweep, "7"], env)
    assert proc.returncode == 2 and "run index 7 out of range" in proc.stderr
    proc = subprocess.run(
        [str(bin_dir / "bash"), str(REPO / "slurm" / "sweep.sh"), str(sweep)],
        env=env,
        text=True,
        capture_output=True,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "no sbatch on PATH" in proc.stderr
    proc = subprocess.run(
        [str(bin_dir / "bash"), str(REPO / "slurm" / "sweep.sh"), str(sweep), "--gpus", "x"],
        env=env,
        text=True,
        capture_output=True,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "--gpus" in proc.stderr
