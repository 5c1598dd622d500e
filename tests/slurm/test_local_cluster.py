"""The local SLURM fixture really runs a cluster: sbatch, a 2-task srun, submitit executors."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time

import pytest

from gpn_scale.testing.slurm import LocalSlurm, probe

pytestmark = pytest.mark.slow


def test_cluster_is_up_with_its_own_daemons(slurm_cluster):
    assert {"slurmctld", "slurmd", "munged", "slurmdbd", "mariadbd"} <= set(
        slurm_cluster.daemon_pids()
    )
    assert "UP" in slurm_cluster.run(["scontrol", "ping"]).stdout
    node_state = slurm_cluster.run(["sinfo", "-h", "-o", "%T"]).stdout.split()
    assert node_state and node_state[0] in ("idle", "mixed", "allocated")
    conf = slurm_cluster.run(["scontrol", "show", "config"]).stdout
    assert f"SlurmctldPort           = {slurm_cluster.port_base}" in conf


def test_trivial_sbatch_job_runs(slurm_cluster, tmp_path):
    marker = tmp_path / "ran.txt"
    job = slurm_cluster.sbatch(
        ["--wrap", f"echo job=$SLURM_JOB_ID > {marker}"], output=tmp_path / "out.txt"
    )
    assert slurm_cluster.wait(job) == "COMPLETED"
    assert marker.read_text().strip() == f"job={job}"
    # accounting saw it too (exit code 0)
    sacct = slurm_cluster.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State,ExitCode"])
    assert sacct.stdout.split()[0] == "COMPLETED|0:0"


def test_failing_job_is_reported_failed(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch(["--wrap", "exit 3"], output=tmp_path / "out.txt")
    assert slurm_cluster.wait(job) == "FAILED"


def test_two_task_srun_gives_two_ranks(slurm_cluster, tmp_path):
    out = tmp_path / "ranks.txt"
    job = slurm_cluster.sbatch(
        ["--ntasks=2", "--wrap", 'srun -l bash -c "echo rank=\\$SLURM_PROCID of=\\$SLURM_NTASKS"'],
        output=out,
    )
    assert slurm_cluster.wait(job) == "COMPLETED"
    lines = sorted(
        line.split(":", 1)[1].strip() for line in out.read_text().splitlines() if ":" in line
    )
    assert lines == ["rank=0 of=2", "rank=1 of=2"]


def sacct_state(job, timeout=30.0):
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        state = job.get_info(mode="force").get("State")
        if state not in (None, "PENDING", "RUNNING", "COMPLETING"):
            break
        time.sleep(0.5)
    return state


def test_submitit_slurm_executor_runs_a_function(slurm_env, tmp_path):
    import submitit

    executor = submitit.SlurmExecutor(folder=tmp_path / "submitit")
    executor.update_parameters(time=2, ntasks_per_node=1, cpus_per_task=1, mem="200M")
    job = executor.submit(probe, 21)
    result = job.result()
    assert result == {"x2": 42, "job": job.job_id, "rank": "0", "host": socket.gethostname()}
    # submitit reads job states through sacct: accounting (slurmdbd) must see the job finish
    assert sacct_state(job) == "COMPLETED"


def test_submitit_auto_executor_runs_on_the_cluster(slurm_env, tmp_path):
    import submitit

    executor = submitit.AutoExecutor(folder=tmp_path / "auto", cluster="slurm")
    executor.update_parameters(timeout_min=2, tasks_per_node=2, cpus_per_task=1, slurm_mem="200M")
    assert executor.cluster == "slurm"
    job = executor.submit(probe, 5)
    results = job.results()  # one per task
    assert [r["x2"] for r in results] == [10, 10]
    assert {r["job"] for r in results} == {job.job_id}
    assert sorted(r["rank"] for r in results) == ["0", "1"]


def test_start_is_idempotent_and_stop_stops_every_daemon(tmp_path_factory):
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm2"), with_dbd=False, cpus=2)
    try:
        cluster.start()
        pids = cluster.daemon_pids()
        assert set(pids) == {"slurmctld", "slurmd", "munged"}
        cluster.start()  # second start: nothing restarted
        assert cluster.daemon_pids() == pids
        job = cluster.sbatch(["--wrap", "true"], output=cluster.state_dir / "o.txt")
        assert cluster.wait(job) == "COMPLETED"
    finally:
        cluster.stop()
    assert cluster.daemon_pids() == {}
    for pid in pids.values():
        assert (
            not os.path.exists(f"/proc/{pid}/comm")
            or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        )


def test_stop_removes_a_state_dir_made_here_and_keeps_a_given_one():
    """The suite runs many clusters; one whose state directory LocalSlurm made in /tmp must
    not outlive it (they piled up over runs), while a directory the caller gave, or the logs of
    a cluster that failed to start, stay for whoever reads them."""
    made = LocalSlurm(with_dbd=False, cpus=1)
    assert made.owns_state_dir and made.state_dir.is_dir()
    made.stop()
    assert not made.state_dir.exists()

    given_dir = tempfile.mkdtemp(prefix="gpn-test-slurm-", dir="/tmp")  # short enough to keep
    try:
        given = LocalSlurm(given_dir, with_dbd=False, cpus=1)
        assert not given.owns_state_dir
        given.stop()
        assert given.state_dir.is_dir()
    finally:
        shutil.rmtree(given_dir, ignore_errors=True)

    failed = LocalSlurm(with_dbd=False, cpus=1)
    failed.start_failed = True  # as start() marks it when start.sh fails or times out
    try:
        failed.stop()
        assert failed.state_dir.is_dir()
    finally:
        failed.stop(purge=True)
    assert not failed.state_dir.exists()
