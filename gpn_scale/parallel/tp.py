"""Tensor parallelism applied to a built model: its parameters become DTensors on the tp mesh.

The family's plan (`tp_plan(model)` in its `parallelize` module, reached through
`FamilySpec.apply_tp`: parameter name -> placement; GPN's is gpn_scale/model/parallelize.py)
says which parameters shard along which axis; every other parameter is replicated (a DTensor
with Replicate(), so that FSDP2, DCP and the gradient norm see one mesh). This is
torchtitan's `parallelize_module` applied to parameters only: the GPN forward reads its
parameters inside one autograd function and never runs a submodule's forward, so module
hooks (ColwiseParallel/RowwiseParallel) would never fire; the collectives sit inside the
engine instead. Order: TP first, then FSDP2 over "dp" of the same parent mesh
(`parallel/fsdp.py`).

The full model is built (and initialised) whole on every rank from the same seed, then
each rank keeps its shard: the same seed gives the same logical model at any tp.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor


def apply_tp(model: nn.Module, tp_mesh: Any, plan: Mapping[str, Any]) -> nn.Module:
    """Replace every parameter of `model` by a DTensor on `tp_mesh` placed as `plan` says."""
    unknown = sorted(set(plan) - {n for n, _ in model.named_parameters()})
    if unknown:
        raise ValueError(f"tp plan names {unknown[0]!r}, which the model does not have")
    prefixes = {id(m): name for name, m in model.named_modules()}

    def partition(_name: str, module: nn.Module, mesh: Any) -> None:
        base = prefixes[id(module)]
        for leaf, param in list(module.named_parameters(recurse=False)):
            full = f"{base}.{leaf}" if base else leaf
            placement = plan.get(full, Replicate())
            # src_data_rank=0: every rank takes its shard of rank 0's tensor (all ranks built
            # the same one from the seed; this makes it so even if they had not).
            dt = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=0)
            module.register_parameter(leaf, nn.Parameter(dt, requires_grad=param.requires_grad))

    distribute_module(model, tp_mesh, partition)
    return model


class TPGroupBatches:
    """A loader wrapper: the ranks of one tp group train on the same batch.

    Every rank keeps an ordinary loader over the whole world (`rank`, `world_size` of the
    process group) reading 1/tp of its group's micro batch, and the group all-gathers the
    pieces in tp-rank order. So each rank's loader stays what it is without tensor
    parallelism (the same collectives at build time, its own resumable position; streaming's
    global sample order is the same for any world size), and the group's batches over dp
    together are exactly the global batch a data-parallel run would read.
    """

    def __init__(self, loader: Any, tp_group: Any, tp_size: int) -> None:
        self.loader, self.group, self.tp = loader, tp_group, tp_size

    def __iter__(self) -> Any:
        import torch
        import torch.distributed as dist

        for piece in self.loader:
            parts = [torch.empty_like(piece) for _ in range(self.tp)]
            dist.all_gather(parts, piece.contiguous(), group=self.group)
            yield torch.cat(parts, dim=0)

    def state_dict(self) -> Any:
        return self.loader.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()

    def __getattr__(self, name: str) -> Any:  # anything else the trainer asks of a loader
        return getattr(self.loader, name)
