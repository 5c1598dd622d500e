"""Small corpora whose every window is unique, so tests can check coverage by content."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from data_tools.build import BuildOptions, build_dataset
from data_tools.tokenizer import resolve_tokenizer


def counter_documents(n_docs: int, lines_per_doc: int = 8) -> list[str]:
    """Documents made of globally numbered 8-byte lines ("0000123\\n"): with the byte
    tokenizer, any window of >= 16 tokens contains a unique number, so windows differ."""
    docs, counter = [], 0
    for _ in range(n_docs):
        docs.append("".join(f"{counter + j:07d}\n" for j in range(lines_per_doc)))
        counter += lines_per_doc
    return docs


def counter_corpus(n_windows: int, seq_len: int = 32) -> list[str]:
    """Documents whose byte tokens (EOD after each) fill exactly n_windows * seq_len."""
    # each counter doc is 8 lines * 8 bytes + 1 EOD = 65 tokens; a last filler document
    # brings the stream to exactly n_windows * seq_len tokens
    target = n_windows * seq_len
    docs = counter_documents(max((target - 1) // 65, 0))
    docs.append("#" * (target - len(docs) * 65 - 1))
    return docs


def expected_window_keys(docs: list[str], seq_len: int) -> list[str]:
    """Keys of every window of the byte-tokenised corpus, in stream order."""
    stream: list[int] = []
    for doc in docs:
        stream.extend(doc.encode())
        stream.append(256)
    windows = torch.tensor(stream[: len(stream) // seq_len * seq_len]).view(-1, seq_len)
    return row_keys([windows])


def build_counter_dataset(
    out: str,
    *,
    n_windows: int,
    seq_len: int = 32,
    val_windows: int = 8,
    seed: int = 0,
    shard_size: str = "2kb",
    overwrite: bool = False,
):
    """A byte-level dataset with exactly `n_windows` windows (train + val)."""
    options = BuildOptions(
        seq_len=seq_len,
        seed=seed,
        val_windows=val_windows,
        shard_size=shard_size,
        overwrite=overwrite,
        progress=False,
    )
    return build_dataset(
        counter_corpus(n_windows, seq_len),
        out,
        resolve_tokenizer("byte"),
        options,
        {"description": "test counters"},
    )


def one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text and text, f"not a one-line message: {text!r}"
    return text


def row_keys(batches: Iterable[torch.Tensor]) -> list[str]:
    """A content key per sample, in order."""
    keys = []
    for batch in batches:
        assert batch.dtype == torch.int64 and batch.dim() == 2
        for row in batch:
            keys.append(hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16])
    return keys


def dump(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj))


def rank_main(
    rank: int, world_size: int, init_file: str, remote: str, out_dir: str, plan: list[dict]
) -> None:
    """Body of one gloo rank (torch.multiprocessing.spawn target). Each step of `plan`:
    {"name", "batch_size", "batches" (None = to the end of the epoch), "state" (path of a
    loader state to restore first, optional), "num_canonical_nodes"}. Writes
    <out_dir>/<name>.rank<r>.json with the sample keys read and the state afterwards."""
    import os

    import torch.distributed as dist

    from gpn_scale.data import DataConfig, build_loader

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        for step in plan:
            cfg = DataConfig(
                remote=remote,
                num_canonical_nodes=step["num_canonical_nodes"],
                shuffle_seed=step.get("seed", 1234),
                num_workers=step.get("num_workers", 0),
            )
            loader = build_loader(
                cfg,
                "train",
                step["batch_size"],
                rank,
                world_size,
                seq_len=step.get("seq_len"),
                vocab_size=step.get("vocab"),
            )
            if step.get("state"):
                loader.load_state_dict(json.loads(Path(step["state"]).read_text()))
            keys: list[str] = []
            iterator = iter(loader)
            for i, batch in enumerate(iterator):
                keys.extend(row_keys([batch]))
                if step["batches"] is not None and i + 1 == step["batches"]:
                    break
            dump(
                Path(out_dir) / f"{step['name']}.rank{rank}.json",
                {"keys": keys, "state": loader.state_dict()},
            )
            del iterator, loader
            dist.barrier()
    finally:
        dist.destroy_process_group()
