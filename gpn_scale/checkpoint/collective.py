"""The collectives of a checkpoint save or load: torch.distributed's rank and world size (0
and 1 when it is not initialised), and the exchanges by which every rank learns every rank's
outcome, so that none is left waiting in a collective another one skipped."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from gpn_scale.checkpoint.errors import CheckpointDamaged, CheckpointError


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gather(obj: Any, group: Any = None) -> list[Any]:
    """all_gather_object on `group` (None: the default group; a background save passes
    its own, so it never meets the training's collectives on the same group)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj: Any, group: Any = None) -> Any:
    """Rank 0's `obj` on every rank of `group`."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def agree(error: str | None, what: str, damaged: bool = False) -> list[Any]:
    """Collective: raise the first rank's error on every rank (so no rank is left waiting);
    as CheckpointDamaged when that rank found the checkpoint's files `damaged`."""
    errors = gather((error, damaged))
    for r, (err, bad) in enumerate(errors):
        if err:
            where = f" on rank {r}" if world_size() > 1 else ""
            if bad:
                raise CheckpointDamaged(f"{what}{where}: {err}", reason=err)
            raise CheckpointError(f"{what}{where}: {err}")
    return [err for err, _ in errors]
