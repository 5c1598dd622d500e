"""Two and three real gloo ranks streaming from the local S3 endpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from data_helpers import build_counter_dataset, rank_main

from gpn_scale.data import DataConfig, build_loader

pytestmark = pytest.mark.slow

N_TRAIN = 96  # divisible by 2 ranks x 4 and, after 3 steps, by 3 ranks x 4
BATCH = 4


def _spawn(world_size: int, tmp: Path, tag: str, remote: str, plan: list[dict]) -> None:
    init_file = tmp / f"init-{tag}"
    mp.spawn(
        rank_main,
        args=(world_size, str(init_file), remote, str(tmp), plan),
        nprocs=world_size,
        join=True,
    )


def _read(tmp: Path, name: str, world_size: int) -> list[dict]:
    return [json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in range(world_size)]


def _single_rank_epoch(remote: str, tmp: Path) -> list[str]:
    """All train samples of the split, in stored order (no shuffle), one rank."""
    from data_helpers import row_keys

    cfg = DataConfig(
        remote=remote, shuffle=False, local_cache=str(tmp / "ref-cache"), drop_last=False
    )
    return row_keys(build_loader(cfg, "train", 8, 0, 1))


def test_text_to_s3_two_ranks_cover_epoch_then_resume_on_three(s3_bucket, tmp_path):
    remote = f"{s3_bucket}/counters"
    build_counter_dataset(remote, n_windows=N_TRAIN + 8, val_windows=8)
    everything = _single_rank_epoch(remote, tmp_path)
    assert len(everything) == len(set(everything)) == N_TRAIN

    # Phase 1, two ranks: a whole epoch (coverage), then 3 steps of a fresh loader + state.
    _spawn(
        2,
        tmp_path,
        "a",
        remote,
        [
            {
                "name": "epoch",
                "batch_size": BATCH,
                "batches": None,
                "num_canonical_nodes": 2,
                "seq_len": 32,
                "vocab": 257,
            },
            {"name": "partial", "batch_size": BATCH, "batches": 3, "num_canonical_nodes": 2},
        ],
    )
    epoch = _read(tmp_path, "epoch", 2)
    rank0, rank1 = epoch[0]["keys"], epoch[1]["keys"]
    assert len(rank0) == len(rank1) == N_TRAIN // 2
    assert not set(rank0) & set(rank1), "ranks read overlapping samples"
    assert sorted(rank0 + rank1) == sorted(everything), "the epoch did not cover the split once"

    partial = _read(tmp_path, "partial", 2)
    consumed = partial[0]["keys"] + partial[1]["keys"]
    assert len(consumed) == len(set(consumed)) == 2 * 3 * BATCH
    state = partial[0]["state"]
    assert state == partial[1]["state"]
    assert state["streaming"]["sample_in_epoch"] == 2 * 3 * BATCH
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(state))

    # Phase 2, three ranks restore the two-rank state and finish the epoch.
    _spawn(
        3,
        tmp_path,
        "b",
        remote,
        [
            {
                "name": "resume",
                "batch_size": BATCH,
                "batches": None,
                "num_canonical_nodes": 2,
                "state": str(state_file),
            },
        ],
    )
    rest = [k for r in _read(tmp_path, "resume", 3) for k in r["keys"]]
    assert len(rest) == N_TRAIN - len(consumed)
    assert not set(rest) & set(consumed), "a sample was repeated after the resume"
    assert sorted(consumed + rest) == sorted(everything), "a sample was lost across the resume"
