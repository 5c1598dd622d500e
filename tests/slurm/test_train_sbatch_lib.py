"""The pieces of slurm/train.sbatch, run as shell functions (the template sourced with
GPN_SBATCH_LIB=1): rendezvous port, CPU share, end time and the requeue decision."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parents[2] / "slurm" / "train.sbatch"


def sh(expr: str, **env: str) -> str:
    script = f"GPN_SBATCH_LIB=1 source {TEMPLATE}; {expr}"
    proc = subprocess.run(
        ["bash", "-c", script],
        env={"PATH": "/usr/bin:/bin", **env},
        text=True,
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_sourcing_defines_functions_and_runs_nothing():
    assert sh("type -t node_main requeue_decision") == "function\nfunction"


@pytest.mark.parametrize("job", ["0", "1", "11999", "12000", "987654321"])
def test_rendezvous_port_is_below_the_ephemeral_range(job):
    lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    port = int(sh(f"rdzv_port {job}"))
    assert 20000 <= port < min(lo, 32768)


def test_a_local_clusters_daemons_never_take_a_rendezvous_port():
    """A test cluster's slurmctld/slurmd/slurmdbd/MariaDB ports (gpn_scale/testing/slurm.py)
    sit below every port rdzv_port gives a job: a base of 20019 once made jobs 19-21 of
    that cluster fail with EADDRINUSE."""
    import random

    from gpn_scale.testing.slurm import free_port_base

    lowest_rendezvous = int(sh("rdzv_port 0"))  # 20000 + job id % 12000: lowest at 0
    rng = random.Random(0)
    for _ in range(50):
        base = free_port_base(rng)
        assert 1024 <= base and base + 13 < lowest_rendezvous


def test_each_rank_gets_its_share_of_the_cpus():
    assert sh("threads_per_rank 96 8") == "12"
    assert sh("threads_per_rank 2 4") == "1"


def test_host_addr_resolves_a_name_without_slurm():
    assert sh("host_addr localhost") == "127.0.0.1"
    assert sh("first_host n07,n08") == "n07"


def test_job_end_time_prefers_slurm_job_end_time():
    assert sh("job_end_epoch 5", SLURM_JOB_END_TIME="1796131273") == "1796131273"


@pytest.mark.parametrize(
    "args, want",
    [
        # preempted after progress: requeue, the no-progress count starts over
        ("1 0 1 40 60 1 2 3 50", "requeue 0"),
        # the wall-clock self-exit or a crash after a new checkpoint (no signal seen)
        ("0 0 1 40 60 0 2 3 50", "requeue 0"),
        # preempted before its first new save: requeued, counted, until the cap
        ("1 0 1 40 40 0 2 3 50", "requeue 1"),
        ("1 0 1 40 40 1 2 3 50", "requeue 2"),
        ("1 0 1 40 40 2 2 3 50", "stop 3 requeues in a row"),
        # a failure without progress, a cancel, a finished run, the overall cap
        ("0 0 1 40 40 0 2 3 50", "stop the trainers failed (exit 1)"),
        ("0 1 1 40 60 0 2 3 50", "stop cancelled"),
        ("1 0 0 40 done 0 2 3 50", "stop finished"),
        ("1 0 1 40 60 0 2 50 50", "stop already restarted 50 times"),
    ],
)
def test_requeue_only_on_progress_with_a_cap(args, want):
    assert sh(f"requeue_decision {args}").startswith(want)


def _sbatch_outside_slurm(tmp_path: Path, *args: str, nproc: str = "2"):
    """train.sbatch run as a plain script (no SLURM_JOB_ID: it starts torchrun itself)."""
    import sys

    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "GPN_SCALE_ROOT": str(TEMPLATE.parents[1]),
        "GPN_SCALE_PYTHON": sys.executable,
        "GPN_NPROC_PER_NODE": nproc,
        "GPN_RANK_LOG_DIR": str(tmp_path / "ranks"),
    }
    return subprocess.run(
        ["bash", str(TEMPLATE), *args],
        cwd=tmp_path,
        env=env,
        text=True,
        capture_output=True,
        timeout=120,
    )


def test_tp_that_does_not_split_the_launch_fails_before_any_trainer_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = _sbatch_outside_slurm(tmp_path, "ci_tiny", "parallel.tp=3", f"run_dir={run_dir}")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors == [
        "gpn-scale: error: parallel.tp: 3 does not divide the world size 2 (processes); "
        "launch a multiple of 3 processes or choose a tp that divides 2"
    ]
    assert "torch.distributed.run" not in proc.stdout and not (tmp_path / "ranks").exists()
    assert not run_dir.exists()
