"""The shared-memory prefix of a node's ranks: a patch of streaming's registration (its
private names are declared and checked with the others in `streaming_compat.PRIVATE`).

streaming's get_shm_prefix has every rank scan /dev/shm for the first free prefix on its own;
the local leader creates that prefix's `_locals` segment and the node's other ranks open the
one their own scan found. A prefix another job frees between two ranks' scans gives them
different numbers, and the other rank finds no segment ("shared memory prefix=0 was not
registered by local leader": the suite's FSDP2 test met it while other workers' runs ended).
So every rank still scans (streaming's checks of its local directories run there), and then
takes its local leader's number.
"""

from __future__ import annotations

import importlib
from typing import Any

_DATASET_MODULE = "streaming.base.dataset"
_PREFIX_MODULE = "streaming.base.shared.prefix"


def install_agreed_shm_prefix() -> None:
    """Make the dataset's registration use `agreed_shm_prefix` (once per process)."""
    dataset_module = importlib.import_module(_DATASET_MODULE)
    original = dataset_module.get_shm_prefix
    if getattr(original, "_gpn_scale_agreed", False):
        return

    def get_shm_prefix(streams_local, streams_remote, world, retry=100):  # noqa: ANN001
        return agreed_shm_prefix(original, streams_local, streams_remote, world, retry)

    get_shm_prefix._gpn_scale_agreed = True  # type: ignore[attr-defined]
    setattr(dataset_module, "get_shm_prefix", get_shm_prefix)  # noqa: B010


def agreed_shm_prefix(original, streams_local, streams_remote, world, retry):  # noqa: ANN001
    """streaming's get_shm_prefix (`original`), every rank taking its local leader's scan."""
    prefix = importlib.import_module(_PREFIX_MODULE)
    scan = prefix._check_and_find_retrying
    mine = max(
        scan(streams_local, streams_remote, shm_name=name, retry=retry)
        for name in prefix.SHM_TO_CLEAN
    )
    agreed = local_leaders(mine, world)
    prefix._check_and_find_retrying = lambda *args, **kwargs: agreed
    try:
        return original(streams_local, streams_remote, world, retry)
    finally:
        prefix._check_and_find_retrying = scan


def local_leaders(mine: int, world: Any) -> int:
    """The prefix number this rank's local leader found (this rank's own without
    torch.distributed): every rank of the job gathers (node, leader?, number)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    votes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(votes, (world.node, world.is_local_leader, mine))
    return next((n for node, leader, n in votes if leader and node == world.node), mine)
