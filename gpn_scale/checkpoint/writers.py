"""The files of a checkpoint, written into a rank's staging directory: DCP's shards or
DeepSpeed's own files, the rank's state (RNG) and the small files rank 0 adds. The commit
protocol (manager.py) then hashes, uploads and commits what is there."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from gpn_scale.checkpoint.errors import CheckpointError


def rank_file(rank: int) -> str:
    """The name of rank `rank`'s state file in a step directory."""
    return f"rank_{rank:05d}.pt"


def write_dcp(app_state: dict[str, Any], stage: Path, group: Any = None) -> None:
    """DCP's shards of `app_state` into `stage`, one file per rank (collective on `group`);
    raises what DCP raises (on every rank)."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(
        str(stage), single_file_per_rank=True, sync_files=True, thread_count=1
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.save(app_state, storage_writer=writer, process_group=group)


def write_deepspeed(engine: Any, stage: Path, name: str) -> str | None:
    """engine.save_checkpoint into `stage` (tag `name`); None, or the one line when DeepSpeed
    said it failed. Each rank saves into its own staging root, so the files it staged are
    exactly the files it wrote (no guessing from DeepSpeed's file names)."""
    ok = engine.save_checkpoint(str(stage.parent), tag=name, client_state={}, save_latest=False)
    return "engine.save_checkpoint returned False" if ok is False else None


def write_rank_files(
    stage: Path, rank: int, rank_state: dict[str, Any] | None, files: dict[str, bytes] | None
) -> None:
    """This rank's state (when given) and, on rank 0, the extra `files` into `stage`."""
    if rank_state is not None:
        save_rank_state(rank_state, stage / rank_file(rank))
    if rank != 0 or not files:
        return
    for rel, content in files.items():
        if "/" in rel or rel.startswith(".") or rank_file(0)[:5] in rel:
            raise CheckpointError(f"extra checkpoint file {rel!r}: give a plain file name")
        (stage / rel).write_bytes(content)


def save_rank_state(state: dict[str, Any], path: Path) -> None:
    """torch.save through a Python file: a full disk is then an OSError (ENOSPC), not the
    "unexpected pos 10048 vs 9936" of torch's own file writer."""
    with open(path, "wb") as f:
        torch.save(state, f)
