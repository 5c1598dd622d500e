"""A real two-node SLURM cluster on this machine (network + UTS + mount/IPC namespaces joined
by a veth link; see slurm/local/two_nodes.sh): a 2-node x 2-process CPU run (FSDP2 over
gloo across the link) through slurm/train.sbatch trains, is preempted with USR1 on one node
only (the other learns it through the trainers' all-reduce), is requeued by the template
because its newest checkpoint advanced, and resumes to the same per-step losses (==) as an
uninterrupted twin that runs beside it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpn_scale.testing.slurm import SlurmStartError, TwoNodeSlurm
from gpn_scale.train.metrics import read_jsonl

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def two_nodes():
    cluster = TwoNodeSlurm()
    try:
        cluster.start()
    except SlurmStartError as err:
        cluster.stop()
        pytest.fail(f"could not start the two-node SLURM cluster: {err}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop(purge=True)


def _losses(run_dir: Path) -> dict[int, float]:
    try:
        rows = read_jsonl(run_dir / "metrics.jsonl", live=True)
    except (OSError, json.JSONDecodeError):
        return {}
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def test_two_nodes_train_preempt_one_node_requeue_and_resume_exactly(
    two_nodes, tmp_path, default_corpus
):
    corpus = default_corpus
    env = dict(os.environ)
    env.update(
        PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}",
        GPN_SCALE_ROOT=str(REPO),
        GPN_SCALE_PYTHON=sys.executable,
        GPN_NPROC_PER_NODE="2",
        GPN_SOCKET_IFNAME=two_nodes.interface,
        GPN_RANK_LOG_DIR=str(tmp_path / "ranks"),
        GPN_NODE_SCRATCH=str(tmp_path / "scratch"),
        WANDB_SILENT="true",
    )
    env.pop("OMP_NUM_THREADS", None)  # the template sets each rank's share
    args = [
        "ci_tiny",
        f"data.remote={corpus}",
        "data.seq_len=64",
        "schedule.total_steps=12",
        "checkpoint.every_steps=4",
        "parallel.backend=fsdp2",
    ]
    sbatch = [
        "sbatch",
        "--parsable",
        "-N2",
        "--cpus-per-task=2",
        "--time=10",
        str(REPO / "slurm" / "train.sbatch"),
    ]

    def submit(name: str, *extra: str) -> str:
        cmd = [*two_nodes.prefix(), *sbatch[:2], "-o", str(tmp_path / f"{name}.out"), *sbatch[2:]]
        proc = subprocess.run(
            cmd + args + [f"run_dir={tmp_path / name}", *extra],
            env=two_nodes.env(env),
            text=True,
            capture_output=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    victim = submit("victim", "debug.step_sleep=1")
    # Beside the victim on the same two nodes: two multi-node jobs registering streaming's
    # shared memory at once (the registration locks are taken all-or-nothing per job,
    # data/shm.py; one node at a time they deadlocked here once).
    twin = submit("twin")
    victim_dir = tmp_path / "victim"
    deadline = time.monotonic() + 240
    while max(_losses(victim_dir), default=0) < 5:  # past its first checkpoint (step 4)
        assert time.monotonic() < deadline, (tmp_path / "victim.out").read_text()[-3000:]
        time.sleep(0.3)
    # USR1 to node n2's torchrun and trainers only, as SLURM would signal that node's step
    pids = two_nodes.node_pids("n2", f"run_dir={victim_dir}")
    assert len(pids) >= 3, pids  # torchrun + 2 trainers
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)

    assert two_nodes.wait(victim, timeout=300) == "COMPLETED"
    assert two_nodes.wait(twin, timeout=300) == "COMPLETED"
    out = (tmp_path / "victim.out").read_text()
    assert "requeueing job" in out and "restart 1" in out, out[-3000:]
    rows = read_jsonl(victim_dir / "metrics.jsonl")
    assert [r["event"] for r in rows if "event" in r].count("preempted") == 1
    # the rendezvous ran on n1's veth address, not on a host name
    node = two_nodes.run(["scontrol", "show", "node", "n1"]).stdout
    assert f"rendezvous {node.split('NodeAddr=')[1].split()[0]}:" in out
    got, want = _losses(victim_dir), _losses(tmp_path / "twin")
    assert sorted(want) == list(range(1, 13)) and got == want
    assert list((tmp_path / "scratch").iterdir()) == []  # node-local scratch cleaned
    assert len(list((tmp_path / "ranks").rglob("stdout.log"))) == 2 * 2 * 2 + 2 * 2  # per rank
