"""Tensor parallelism's data side: the ranks of one tp group train on the same batch.

The model side is the family's: `FamilySpec.apply_tp(model, tp_mesh)` shards the built model
in place (GPN: its parameter placements, gpn_scale/models/gpn/parallelize.py; the baselines:
torch's parallelize_module styles), called by `parallel.train_module.build_train_module` first,
before FSDP2 over "dp" of the same parent mesh (torchtitan's order).
"""

from __future__ import annotations

from typing import Any


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
