"""Where a process is in its job (gpn_scale/core/env.py): torchrun's and SLURM's variables."""

from __future__ import annotations

from gpn_scale.core.env import _first_host, detect


def test_env_detection():
    assert detect({}).world_size == 1
    tr = detect(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "h1",
            "MASTER_PORT": "1234",
        }
    )
    assert (tr.rank, tr.world_size, tr.local_rank, tr.master_addr, tr.master_port, tr.source) == (
        3,
        8,
        1,
        "h1",
        1234,
        "torchrun",
    )
    sl = detect(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "16",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "gpu[07-08,11],cpu1",
            "SLURM_TASKS_PER_NODE": "8(x2)",
        }
    )
    assert (sl.rank, sl.world_size, sl.local_rank, sl.source) == (5, 16, 1, "slurm")
    assert sl.local_world_size == 8
    assert sl.master_addr in ("gpu07",) and sl.master_port == 20000 + 4242
    assert _first_host("node[3-5]") == "node3" and _first_host("a1,b2") == "a1"
