"""The one place that creates process groups and device meshes.

The mesh has named dimensions: ("dp",) without tensor parallelism, ("dp", "tp") with it
(`parallel.tp` > 1; tp innermost, so a tp group is tp consecutive ranks: one node's GPUs).
FSDP2 shards / DeepSpeed ZeRO partitions across "dp"; the tp ranks of one group train on the
same batch and hold their shares of the model (the family's `apply_tp`). Without tp the loaders read
by `dp_rank` / `dp_size`; under tp each rank reads 1/tp of its group's batch by its global rank
and the group gathers the pieces (`parallel.tp.TPGroupBatches`), so no two ranks read a row
twice.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gpn_scale.core.env import DistEnv, check_world, export_for_torch


@dataclass
class Topology:
    env: DistEnv
    device: torch.device
    backend: str | None  # process-group backend ("gloo" / "nccl"), None when single
    mesh: Any = None  # torch DeviceMesh with dims ("dp",) or ("dp", "tp")

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size() if self.mesh is not None else 1

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def dp_mesh(self) -> Any:
        return self.mesh["dp"] if self.mesh is not None else None

    @property
    def tp_size(self) -> int:
        return self.mesh["tp"].size() if self._has_tp else 1

    @property
    def tp_mesh(self) -> Any:
        return self.mesh["tp"] if self._has_tp else None

    @property
    def _has_tp(self) -> bool:
        return self.mesh is not None and "tp" in (self.mesh.mesh_dim_names or ())

    # ----- collectives the loop needs (no-ops on one process) ---------------------
    def all_reduce_max(self, value: float) -> float:
        if not self.env.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._coll_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        if not self.env.distributed:
            return value
        t = value.detach().to(self._coll_device(), torch.float64).clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t / self.world_size

    def sum_over_data_parallel(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over the data-parallel ranks, on the CPU (the ranks of a tp group hold
        the same sums: each counts once)."""
        if not self.env.distributed:
            return value
        t = value.to(self._coll_device()).clone()
        if self.tp_size > 1:
            dist.all_reduce(t, group=self.dp_mesh.get_group())
        else:
            dist.all_reduce(t)
        return t.cpu()

    def barrier(self) -> None:
        if self.env.distributed:
            dist.barrier()

    def _coll_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    """A free TCP port on this host (a one-process group's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_device(requested: str, local_rank: int) -> torch.device:
    """This rank's device for `train.device` (auto, cpu, cuda): CUDA device local_rank (mod
    the GPUs visible), made current. A command's `--device` flag is core.hardware's
    pick_device."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        from gpn_scale.core.config import ConfigError

        raise ConfigError(
            "train.device: cuda requested but no GPU is visible; use train.device=cpu"
        )
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def init_topology(
    dist_env: DistEnv,
    device_request: str = "auto",
    tp: int = 1,
    init_pg: bool = True,
    timeout_s: float = 600.0,
    group_for_one: bool = False,
) -> Topology:
    """Start the default process group (if several processes) and the device mesh.

    `init_pg=False` lets DeepSpeed start the group itself (deepspeed.init_distributed), after
    which the mesh is built over the same group. `group_for_one=True` builds a 1-rank group
    and mesh for a single process (FSDP2 / DeepSpeed cannot run without one); the
    collectives of the Topology stay no-ops there (world size 1).
    """
    check_world(dist_env.world_size, tp)
    device = rank_device(device_request, dist_env.local_rank)
    if not dist_env.distributed and not group_for_one:
        return Topology(env=dist_env, device=device, backend=None)
    backend = "nccl" if device.type == "cuda" else "gloo"
    export_for_torch(dist_env)
    if init_pg and not dist.is_initialized():
        extra: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            timeout=datetime.timedelta(seconds=timeout_s),
            **extra,
        )
    from torch.distributed.device_mesh import init_device_mesh

    if tp == 1:
        mesh = init_device_mesh(device.type, (dist_env.world_size,), mesh_dim_names=("dp",))
    else:
        mesh = init_device_mesh(
            device.type, (dist_env.world_size // tp, tp), mesh_dim_names=("dp", "tp")
        )
    return Topology(env=dist_env, device=device, backend=backend, mesh=mesh)
