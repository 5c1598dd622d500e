"""Where this process sits in the job: rank, world size, master address.

Sources, first match wins:
1. torchrun / torch.distributed.launch / submitit exports: RANK, WORLD_SIZE, LOCAL_RANK,
   MASTER_ADDR, MASTER_PORT.
2. SLURM (`srun` with one task per GPU): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and the
   first host of SLURM_JOB_NODELIST (expanded with `scontrol show hostnames`, the one tool
   that knows every nodelist syntax; a simple parser is the fallback) as the master.
3. Otherwise a single process.
`export_for_torch()` writes the result back into os.environ so that
`torch.distributed.init_process_group(init_method="env://")` finds it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm" | "single"
    slurm_job_id: str | None = None
    local_world_size: int = 1  # processes on this node (streaming's node detection)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _first_host(nodelist: str) -> str:
    """First hostname of a SLURM nodelist ("node[03-05,07],gpu1" -> "node03")."""
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                check=True,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.split()
            if out:
                return out[0]
        except (subprocess.SubprocessError, OSError):
            pass
    first = re.split(r",(?![^\[]*\])", nodelist)[0]
    m = re.match(r"^([^\[]+)\[([^\]]+)\]", first)
    if not m:
        return first
    prefix, ranges = m.groups()
    return prefix + ranges.split(",")[0].split("-")[0]


def _slurm_tasks_per_node(env) -> int:
    """Tasks on this node: SLURM_NTASKS_PER_NODE, else the first of SLURM_TASKS_PER_NODE
    ("8(x2)" / "8,4"); homogeneous nodes assumed (the usual one task per GPU)."""
    value = (
        env.get("SLURM_NTASKS_PER_NODE")
        or env.get("SLURM_STEP_TASKS_PER_NODE")
        or env.get("SLURM_TASKS_PER_NODE")
        or env.get("SLURM_NTASKS", "1")
    )
    m = re.match(r"\d+", value)
    return int(m.group(0)) if m else 1


def detect(environ: dict[str, str] | None = None) -> DistEnv:
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", "29500")),
            source="torchrun",
            slurm_job_id=job,
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        )
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        # A port derived from the job id: distinct per job on shared nodes, same on all ranks,
        # below Linux's ephemeral range (32768-60999) that outgoing connections draw from.
        port = int(env.get("MASTER_PORT") or 20000 + int(job or 0) % 12000)
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            master_addr=env.get("MASTER_ADDR") or _first_host(nodelist),
            master_port=port,
            source="slurm",
            slurm_job_id=job,
            local_world_size=_slurm_tasks_per_node(env),
        )
    return DistEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        master_addr="127.0.0.1",
        master_port=int(env.get("MASTER_PORT", "29500")),
        source="single",
        slurm_job_id=job,
    )


def export_for_torch(dist_env: DistEnv) -> None:
    """Make env:// initialisation see the detected values (SLURM does not set them)."""
    os.environ.update(
        {
            "RANK": str(dist_env.rank),
            "WORLD_SIZE": str(dist_env.world_size),
            "LOCAL_RANK": str(dist_env.local_rank),
            "MASTER_ADDR": dist_env.master_addr,
            "MASTER_PORT": str(dist_env.master_port),
            "LOCAL_WORLD_SIZE": str(dist_env.local_world_size),
        }
    )


def check_world(world_size: int, tp: int) -> None:
    """One line naming the field when the world does not split into tp groups (no torch:
    train.sbatch's launch check runs it before any trainer starts)."""
    if tp < 1 or world_size % tp:
        from gpn_scale.core.config import ConfigError

        raise ConfigError(
            f"parallel.tp: {tp} does not divide the world size {world_size} (processes); "
            f"launch a multiple of {tp} processes or choose a tp that divides {world_size}"
        )
