"""`gpn-scale sweep submit` through submitit: the local executor (a laptop) and the SLURM
executor (the local cluster), then `gpn-scale sweep status` and a re-submit that skips
finished runs. A 2-size x 1-seed slice of the CI sweep keeps it short."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from sweep_helpers import REPO, job_env, losses, write_sweep

pytestmark = pytest.mark.slow


def _gpn(args, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "gpn_scale.cli", *map(str, args)], env=env,
                          cwd=REPO, text=True, capture_output=True, timeout=timeout)


def _sweep(tmp_path, checkpoint_root):
    return write_sweep(tmp_path / "sub.yaml", checkpoint_root=checkpoint_root,
                       run_root=tmp_path / "runs", seeds=[0], name="subci",
                       models=[{"config": "tiny"}, {"config": "tiny_2l"}],
                       tokens=2048, overrides=["logging.wandb.mode=offline"])


def _check_finished(sweep, env):
    status = json.loads(_gpn(["sweep", "status", sweep, "--json"], env).stdout)["runs"]
    assert [r["state"] for r in status] == ["done", "done"], status
    assert all(r["step"] == r["total_steps"] and r["eval_loss"] > 0 and r["restarts"] == 0
               for r in status)
    again = _gpn(["sweep", "submit", sweep, "--executor", "local"], env)
    assert again.returncode == 0 and "nothing to submit" in again.stdout, again.stderr
    return status


def test_submit_local_executor(tmp_path):
    sweep = _sweep(tmp_path, str(tmp_path / "ckpt"))
    env = job_env()
    env.pop("SLURM_JOB_ID", None)
    proc = _gpn(["sweep", "submit", sweep, "--executor", "local", "--wait",
                 "--folder", tmp_path / "submitit"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("as local job") == 2 and "all 2 jobs finished" in proc.stdout
    _check_finished(sweep, env)
    for name in ("subci-tiny-s0", "subci-tiny_2l-s0"):
        assert sorted(losses(tmp_path / "runs" / name)) == list(range(1, 9))
        assert (tmp_path / "ckpt" / name / "DONE").is_file()


def test_submit_slurm_executor(slurm_env, s3_endpoint, tmp_path):
    bucket = s3_endpoint.create_bucket("subci-slurm")
    sweep = _sweep(tmp_path, f"{bucket}/ckpt")
    env = job_env()
    proc = _gpn(["sweep", "submit", sweep, "--executor", "slurm", "--time-min", "10",
                 "--cpus-per-task", "1", "--folder", tmp_path / "submitit"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = [line.rsplit(" ", 1)[1] for line in proc.stdout.splitlines() if "slurm job" in line]
    assert len(jobs) == 2
    # while they are queued or running, status shows their SLURM jobs
    table = _gpn(["sweep", "status", sweep], env).stdout
    assert any(j in table for j in jobs), table
    for j in jobs:
        assert slurm_env.wait(j, timeout=240) == "COMPLETED", \
            list((tmp_path / "submitit").rglob("*.err"))
    _check_finished(sweep, env)
    # the submitit job ran under SLURM: its log names the job
    logs = "".join(p.read_text() for p in (tmp_path / "submitit").rglob("*_log.out"))
    assert all(f"job {j}" in logs.lower() or j in logs for j in jobs)


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
    proc = subprocess.run([str(bin_dir / "bash"), str(REPO / "slurm" / "sweep.sh"), str(sweep)], env=env,
                          text=True, capture_output=True, cwd=REPO)
    assert proc.returncode == 2 and "no sbatch on PATH" in proc.stderr
    proc = subprocess.run([str(bin_dir / "bash"), str(REPO / "slurm" / "sweep.sh"), str(sweep), "--gpus", "x"],
                          env=env, text=True, capture_output=True, cwd=REPO)
    assert proc.returncode == 2 and "--gpus" in proc.stderr
