"""The data a run reads: its corpus (the embedded default built once per run folder, or
`data.remote`) and its loaders, split over the data-parallel ranks (and over a tp group's
ranks under tensor parallelism)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gpn_scale.core.config import ConfigError
from gpn_scale.io.run_folder import DEFAULT_CORPUS, default_corpus_dir
from gpn_scale.parallel.topology import Topology
from gpn_scale.run.config import TrainConfig


def data_remote(cfg: TrainConfig, run_dir: str, topo: Topology) -> str:
    """data.remote, or the embedded default corpus, built once per run dir by rank 0
    (the others wait)."""
    if cfg.data.remote != DEFAULT_CORPUS:
        return cfg.data.remote
    out = default_corpus_dir(run_dir, cfg.data.seq_len)
    if topo.is_main:
        from data_tools.default_corpus import build_default_dataset

        root = build_default_dataset(str(out), seq_len=cfg.data.seq_len, seed=0)
    topo.barrier()
    return str(root) if topo.is_main else str(out)


def build_loader(
    cfg: TrainConfig,
    topo: Topology,
    split: str,
    batch: int,
    remote: str,
    vocab: int,
    cache: str,
) -> tuple[Any, Any]:
    """(the streaming loader, the batches the loop reads): the same object except under
    tensor parallelism, where a tp group's ranks each read 1/tp of its batch and share it."""
    from gpn_scale.data import DataConfig
    from gpn_scale.data import build_loader as build_streaming_loader

    dcfg = DataConfig(
        remote=remote,
        local_cache=cache,
        shuffle_seed=cfg.data.shuffle_seed,
        num_canonical_nodes=cfg.data.num_canonical_nodes,
        num_workers=cfg.data.num_workers,
        cache_limit=cfg.data.cache_limit,
    )
    tp = topo.tp_size
    if batch % tp:
        raise ConfigError(
            f"parallel.tp: {tp} does not divide the {split} micro batch {batch} per data-"
            "parallel rank (a tp group reads it in tp pieces); change the batch or tp"
        )
    loader = build_streaming_loader(
        dcfg,
        split=split,
        batch_size=batch // tp,
        # Under TP every rank reads 1/tp of its group's batch (parallel/tp.py).
        rank=topo.dp_rank if tp == 1 else topo.rank,
        world_size=topo.dp_size if tp == 1 else topo.world_size,
        seq_len=cfg.data.seq_len,
        vocab_size=vocab,
    )
    if tp > 1:
        from gpn_scale.parallel.tp import TPGroupBatches

        return loader, TPGroupBatches(loader, topo.tp_mesh.get_group(), tp)
    return loader, loader


def endless_batches(loader: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The training batches, epoch after epoch (iterating the loader again starts the next)."""
    while True:
        got = False
        for batch in loader:
            got = True
            yield batch
        if not got:  # a data error (exit 2) like the others, not a training failure
            from gpn_scale.data import DataError

            raise DataError(
                "the training split yielded no batch; lower "
                "train.global_batch_size or use more data"
            )
