"""Training and validation loaders over MosaicML streaming.

`build_loader` reads the dataset metadata first (one clear error for a wrong path, bad
credentials, an unreachable endpoint or a model that does not fit the data), then wraps
`StreamingDataset` + `StreamingDataLoader`:

- remote is `s3://bucket/prefix` or a local directory; shards are copied into a local
  cache (default: a per-run temporary directory shared by the ranks of one node);
- shuffling is seeded, and `num_canonical_nodes` fixes the global sample order so that a
  job resumed on another number of ranks continues the same epoch;
- `state_dict()` counts the batches this loader has *handed to the training loop*
  (streaming's `StreamingDataLoader` counts in the main process, after prefetch and
  workers), so restoring it yields exactly the samples not yet consumed;
- stale `/dev/shm` segments and filelocks of killed jobs are cleaned before streaming
  starts, and jobs starting together on one machine register their shared memory one at a
  time (see `shm.py`);
- every reach into streaming's private API (the dataset's overrides but `__iter__`, its
  shared-memory handles, the `s3://` downloader) is in `streaming_compat.py`, checked
  against the installed streaming when the first loader is built.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import re
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpn_scale.data import streaming_compat
from gpn_scale.data.errors import DataError
from gpn_scale.data.metadata import DatasetMetadata, check_compatible, read_metadata
from gpn_scale.data.shm import (
    clean_stale_streaming_shm,
    record_owner,
    registration_lock,
    untrack_streaming_segments,
)
from gpn_scale.data.storage import Location, join

STATE_VERSION = 1


@dataclass
class DataConfig:
    """Where the data lives and how it is streamed (one per run, shared by all ranks)."""

    remote: str  # s3://bucket/prefix or a local dataset root
    local_cache: str | None = None  # default: a per-run temporary directory
    shuffle: bool = True  # training split only; val is never shuffled
    shuffle_seed: int = 1234
    # Fix this (e.g. 8, or the largest node count you will use) to keep one sample order
    # across node counts; None lets streaming pick from the first run's node count, and
    # resumed runs then reuse the value stored in the loader state.
    num_canonical_nodes: int | None = None
    num_workers: int = 0
    predownload: int | None = None  # samples to download ahead per worker
    drop_last: bool = True
    validate_hash: str | None = "xxh64"  # checked on every shard download
    download_timeout: float = 120.0
    cache_limit: str | None = None  # e.g. "50gb": evict shards beyond it


def collate_tokens(samples: list[dict[str, Any]]) -> torch.Tensor:
    """Stack stored windows (uint16/uint32) into an int64 [batch, seq_len] tensor."""
    return torch.from_numpy(np.stack([s["tokens"] for s in samples]).astype(np.int64))


def _ensure_world_env(rank: int, world_size: int) -> None:
    """streaming reads the topology from RANK/WORLD_SIZE/LOCAL_* (torchrun's variables).
    Fill them in when absent (single node assumed); refuse if they contradict the caller."""
    for name, value in (("RANK", rank), ("WORLD_SIZE", world_size)):
        current = os.environ.get(name)
        if current is not None and int(current) != value:
            raise DataError(
                f"build_loader got {name.lower()}={value} but the environment has "
                f"{name}={current}; pass the torch.distributed rank/world size"
            )
    if not 0 <= rank < world_size:
        raise DataError(
            f"rank {rank} is outside world_size {world_size}; pass 0 <= rank < world_size"
        )
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    os.environ.setdefault("LOCAL_RANK", str(rank % int(os.environ["LOCAL_WORLD_SIZE"])))


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _per_run_cache(world_size: int) -> tuple[str, bool]:
    """A fresh cache directory name, the same on every rank of this run.
    Returns (path, owned_by_this_process)."""
    if world_size > 1:
        if not _dist_ready():
            raise DataError(
                "world_size > 1 needs torch.distributed initialised before "
                "build_loader (or set DataConfig.local_cache to a directory "
                "shared by the ranks of a node)"
            )
        token = [uuid.uuid4().hex[:12] if torch.distributed.get_rank() == 0 else None]
        torch.distributed.broadcast_object_list(token, src=0)
        run_id = token[0]
    else:
        run_id = uuid.uuid4().hex[:12]
    path = os.path.join(tempfile.gettempdir(), "gpn-data-cache", f"run-{run_id}")
    return path, int(os.environ.get("LOCAL_RANK", "0")) == 0


_CHECKSUM = re.compile(r"Checksum failure: (\S+)")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _not_found_on_s3(cause: BaseException) -> bool:
    try:
        from botocore.exceptions import ClientError
    except ImportError:  # pragma: no cover - boto3 is a dependency
        return False
    if not isinstance(cause, ClientError):
        return False
    code = str(cause.response.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


def _setup_problem(cause: BaseException, text: str, root: str, split: str, cache: str) -> str:
    """The one-line message for a bad index, a cache limit or a full cache disk, or ''."""
    lowered = text.lower()
    if isinstance(cause, json.JSONDecodeError) or "index file at" in lowered:
        return (
            f"{root}/{split}/index.json is not a valid index ({text}); run `gpn-data verify "
            f"{root}` and rebuild the dataset with --overwrite"
        )
    if "cache_limit" in text or "cache limit" in lowered:
        return (
            f"data.cache_limit is too small for the shards of {root}/{split} ({text}); raise "
            "data.cache_limit (at least 4 times the largest shard) or unset it"
        )
    if (isinstance(cause, OSError) and cause.errno in _DISK_FULL) or (
        "no space left on device" in lowered or "disk quota exceeded" in lowered
    ):
        where = f" in {cache}" if cache else ""
        return (
            f"the data cache is full: no space left on device{where} for the shards of "
            f"{root}/{split} ({text}); set data.cache_limit (e.g. 20gb) to bound the cache, or "
            "data.local_cache to a disk with room"
        )
    return ""


def translate_stream_error(
    err: BaseException,
    remote: str,
    split: str,
    background: BaseException | None = None,
    cache: str = "",
) -> BaseException:
    """Name the problem behind a streaming failure in one line (or return `err` as is)."""
    if isinstance(err, DataError):
        return err
    cause = background or err
    if isinstance(cause, DataError):
        return cause
    text = " ".join(f"{cause}".split())
    root = remote.rstrip("/")
    match = _CHECKSUM.search(text)
    if match:
        shard = os.path.basename(match.group(1))
        return DataError(
            f"corrupted shard {root}/{split}/{shard}: its hash does not match "
            f"the index; run `gpn-data verify {root}` and rebuild the dataset "
            "with --overwrite"
        )
    if isinstance(cause, FileNotFoundError) and cause.filename:
        shard = os.path.basename(str(cause.filename))
        return DataError(
            f"shard {root}/{split}/{shard} is missing (listed in the index but "
            f"not found); run `gpn-data verify {root}` and rebuild the dataset "
            "with --overwrite"
        )
    problem = _setup_problem(cause, text, root, split, cache)
    if problem:
        return DataError(problem)
    if _not_found_on_s3(cause):  # before the text checks: the key names a .zstd file
        return DataError(
            f"a shard of {root}/{split} is missing on S3 ({text}); run "
            f"`gpn-data verify {root}` and rebuild with --overwrite"
        )
    if ("zstd" in text.lower() or "decompress" in text.lower()) and not isinstance(
        cause, FileNotFoundError
    ):
        return DataError(
            f"a shard of {root}/{split} does not decompress ({text}); run "
            f"`gpn-data verify {root}` and rebuild with --overwrite"
        )
    try:
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(cause, (BotoCoreError, ClientError)):
            from gpn_scale.data.storage import translate_s3_error

            return translate_s3_error(cause, f"{root}/{split}")
    except ImportError:  # pragma: no cover - boto3 is a dependency
        pass
    if isinstance(cause, FileNotFoundError) or "does not exist" in text:
        return DataError(
            f"a shard of {root}/{split} is missing ({text}); run "
            f"`gpn-data verify {root}` and rebuild with --overwrite"
        )
    return err


def _token_dataset_class() -> type:
    """The patched StreamingDataset (data/streaming_compat.py: it remembers failures of its
    download threads, and neither hangs nor leaks on them), whose epochs raise those failures
    as one-line DataErrors."""

    class TokenStreamingDataset(streaming_compat.patched_dataset_class()):  # type: ignore[misc]
        _gpn_remote: str = ""  # set by build_loader, for error messages
        _gpn_split: str = ""
        _gpn_cache: str = ""

        def __iter__(self) -> Iterator[dict[str, Any]]:
            untrack_streaming_segments()  # a DataLoader worker of another start method
            self._background_error = None
            try:
                yield from super().__iter__()
            except Exception as err:  # noqa: BLE001 - translated or re-raised as is
                translated = translate_stream_error(
                    err, self._gpn_remote, self._gpn_split, self._background_error,
                    self._gpn_cache,
                )  # fmt: skip
                if translated is err:
                    raise
                raise translated from err
            # streaming ends the epoch *silently* when a download thread fails (its loops
            # stop on the failure event); a short epoch must not pass for a complete one.
            if self._background_error is not None:
                error = self._background_error
                translated = translate_stream_error(
                    error, self._gpn_remote, self._gpn_split, cache=self._gpn_cache
                )
                raise translated from error

    return TokenStreamingDataset


# Loaders not closed yet (weakly held): `close_unclosed_loaders` ends them, for a process
# that builds many and cannot be sure each is closed (the test suite closes them after each
# test: ~12 descriptors each, and the process has 20,000).
_UNCLOSED: weakref.WeakSet[TokenLoader] = weakref.WeakSet()


def close_unclosed_loaders() -> int:
    """Close every loader of this process not closed yet; returns how many."""
    loaders = list(_UNCLOSED)
    for loader in loaders:
        loader.close()
    return len(loaders)


class TokenLoader:
    """Iterate to get int64 [batch_size, seq_len] batches of this rank; iterate again for
    the next epoch. `state_dict()`/`load_state_dict()` save and restore the position."""

    def __init__(
        self,
        loader: Any,
        dataset: Any,
        metadata: DatasetMetadata,
        split: str,
        batch_size: int,
        rank: int,
        world_size: int,
        remote: str,
        cache_dir: str,
    ):
        self._loader = loader
        self.dataset = dataset
        _UNCLOSED.add(self)
        # A loader dropped without close() is closed when it is collected (streaming's exit
        # handlers would keep its shared memory until the process exits). Not at exit:
        # streaming cleans up there itself.
        self._finalizer = weakref.finalize(self, streaming_compat.shut_down, loader, dataset)
        self._finalizer.atexit = False
        self.metadata = metadata
        self.split = split
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.remote = remote
        self.cache_dir = cache_dir
        # True once a pass ran to its end (and no new pass started): the state then
        # points at the start of the next epoch instead of at an exhausted one, so a
        # restore does not begin with an empty pass.
        self._pass_finished = False

    @property
    def seq_len(self) -> int:
        return self.metadata.seq_len

    @property
    def epoch(self) -> int:
        """Epoch of the current (or, before any iteration, next) pass."""
        return max(int(self.dataset.next_epoch) - 1, 0)

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[torch.Tensor]:
        self._pass_finished = False
        try:
            yield from self._loader
            self._pass_finished = True
        except DataError as err:
            # From a worker process, torch re-raises DataError("Caught DataError in
            # DataLoader worker ... Original Traceback ...: DataError: <message>"): keep
            # just the message.
            text = str(err)
            if "DataLoader worker" in text and "DataError: " in text:
                raise DataError(text.rsplit("DataError: ", 1)[1]) from err
            raise
        except Exception as err:  # noqa: BLE001 - errors from workers arrive re-wrapped
            translated = translate_stream_error(err, self.remote, self.split, cache=self.cache_dir)
            if translated is err:
                raise
            raise translated from err

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-able position: epoch and global samples consumed in it (the same on
        every rank; save rank 0's). Valid for any world size on restore."""
        streaming_state = {
            k: (int(v) if isinstance(v, (int, np.integer)) else v)
            for k, v in self._loader.state_dict().items()
        }
        if self._pass_finished:
            streaming_state["epoch"] = int(streaming_state["epoch"]) + 1
            streaming_state["sample_in_epoch"] = 0
        return {
            "version": STATE_VERSION,
            "dataset": self.metadata.fingerprint,
            "split": self.split,
            "streaming": streaming_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by `state_dict()` (possibly on another world size).
        Call on every rank before iterating."""
        version = state.get("version") if isinstance(state, dict) else None
        if version != STATE_VERSION:
            raise DataError(
                f"loader state has version {version!r}, expected {STATE_VERSION}; "
                "start this run from a fresh loader state"
            )
        if state.get("dataset") != self.metadata.fingerprint:
            raise DataError(
                f"loader state belongs to another dataset (fingerprint "
                f"{state.get('dataset')} != {self.metadata.fingerprint} of "
                f"{self.remote}); point remote at the original dataset or start "
                "a fresh loader state"
            )
        if state.get("split") != self.split:
            raise DataError(
                f"loader state is for split {state.get('split')!r}, not "
                f"{self.split!r}; restore it into the {state.get('split')} loader"
            )
        self._loader.load_state_dict(dict(state["streaming"]))
        self._pass_finished = False

    def close(self) -> None:
        """Stop workers and download threads now and release the dataset's shared memory
        (also done when the loader is garbage collected): streaming holds a descriptor per
        segment (~12 per loader) until the process exits, so a process that builds loaders
        again and again (a notebook, eval beside training, the test suite) would run out."""
        _UNCLOSED.discard(self)
        self._finalizer()


# DataLoader workers hand each batch's storage to the main process as a file descriptor,
# over a Unix socket at TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX (multiprocessing's
# resource_sharer). A socket path is at most 107 bytes on Linux; beyond that the bind fails
# in the worker's queue thread, the batch is never sent, and the loader waits forever.
_SOCKET_PATH_MAX = 107
_SOCKET_SUFFIX = len("/pymp-XXXXXXXX/listener-XXXXXXXX")


def check_worker_socket_path(tmp_dir: str | None = None) -> None:
    """DataError (one line) when TMPDIR is too long for the workers' socket (see above)."""
    tmp = tmp_dir or tempfile.gettempdir()
    longest = _SOCKET_PATH_MAX - _SOCKET_SUFFIX
    if len(os.fsencode(tmp)) > longest:
        raise DataError(
            f"data.num_workers > 0 needs a temporary directory of at most {longest} bytes "
            f"(the workers pass batches over a Unix socket under it), got TMPDIR={tmp} "
            f"({len(os.fsencode(tmp))} bytes): set TMPDIR to a shorter path, or data.num_workers=0"
        )


def build_loader(
    cfg: DataConfig,
    split: str,
    batch_size: int,
    rank: int,
    world_size: int,
    *,
    seq_len: int | None = None,
    vocab_size: int | None = None,
    shuffle: bool | None = None,
) -> TokenLoader:
    """A loader over `cfg.remote`/`split` for one rank; `batch_size` is per rank.

    Collective when torch.distributed is initialised: call it on every rank together.
    `seq_len`/`vocab_size`, when given, are checked against the dataset (DataError).
    `shuffle` defaults to `cfg.shuffle` for "train" and False for other splits.
    """
    if batch_size < 1:
        raise DataError(f"batch_size {batch_size}: must be >= 1 (it is per rank)")
    if cfg.num_workers > 0:
        check_worker_socket_path()
    meta = read_metadata(cfg.remote)
    check_compatible(meta, vocab_size=vocab_size, seq_len=seq_len)
    _check_split(cfg.remote, meta, split)

    _ensure_world_env(rank, world_size)
    untrack_streaming_segments()  # before streaming makes a segment (shm.py says why)
    local_leader = int(os.environ["LOCAL_RANK"]) == 0
    cache_dir = _prepare_cache(cfg, split, world_size, local_leader)

    # `import streaming` without transformers (streaming_import.py), checked once per process
    # against the private names the patches use (streaming_compat.py)
    streaming_compat.import_streaming()
    from streaming import StreamingDataLoader

    streaming_compat.install_s3_downloader()  # shards through gpn_scale.io (s3_download.py)
    do_shuffle = (cfg.shuffle and split == "train") if shuffle is None else shuffle
    dataset = _open_dataset(cfg, split, cache_dir, batch_size, do_shuffle, local_leader)
    dataset._gpn_remote, dataset._gpn_split = cfg.remote, split
    dataset._gpn_cache = cache_dir
    try:
        loader = StreamingDataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=cfg.num_workers,
            collate_fn=collate_tokens,
            drop_last=cfg.drop_last,
            persistent_workers=False,
            pin_memory=False,
        )
    except BaseException:
        streaming_compat.release_shared_memory(dataset)
        raise
    return TokenLoader(
        loader, dataset, meta, split, batch_size, rank, world_size, cfg.remote, cache_dir
    )


def _check_split(remote: str, meta: DatasetMetadata, split: str) -> None:
    """`split` is in the dataset, its index is there, and it holds samples (else DataError)."""
    if split not in meta.splits:
        raise DataError(
            f"{remote}: no split {split!r} (has {sorted(meta.splits)}); use one of those"
        )
    location = Location(remote)
    if not location.exists(f"{split}/index.json"):
        raise DataError(
            f"{location.url(split + '/index.json')}: missing index; the split "
            "was deleted or the build was interrupted: rebuild with --overwrite"
        )
    if meta.splits[split].samples == 0:
        raise DataError(
            f"{remote}: split {split!r} is empty; build with more text or a smaller --seq-len"
        )


def _prepare_cache(cfg: DataConfig, split: str, world_size: int, local_leader: bool) -> str:
    """The local cache directory (cfg.local_cache, else one of this run's own, removed at
    exit): the node's leader makes it and cleans stale shared memory, while the other ranks
    wait at a barrier (nobody registers segments while the leader cleans)."""
    if cfg.local_cache:
        cache_dir, owned = os.path.abspath(cfg.local_cache), False
    else:
        cache_dir, owned = _per_run_cache(world_size)
    if local_leader:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        clean_stale_streaming_shm(our_locals=[os.path.join(cache_dir, split)])
        if owned:
            atexit.register(shutil.rmtree, cache_dir, True)
    if _dist_ready():
        torch.distributed.barrier()  # nobody registers segments while the leader cleans
    return cache_dir


def _open_dataset(
    cfg: DataConfig,
    split: str,
    cache_dir: str,
    batch_size: int,
    do_shuffle: bool,
    local_leader: bool,
) -> Any:
    """The streaming dataset of `split`, its prefix registered under the node's lock (the
    leader records itself as the prefix's owner); streaming's errors said in one line."""
    dataset_cls = _token_dataset_class()
    opened: list[Any] = []
    try:
        with registration_lock(local_leader), streaming_compat.collect_shared_memory() as opened:
            dataset = dataset_cls(
                remote=join(cfg.remote, split),
                local=os.path.join(cache_dir, split),
                shuffle=do_shuffle,
                shuffle_seed=cfg.shuffle_seed,
                num_canonical_nodes=cfg.num_canonical_nodes,
                batch_size=batch_size,
                predownload=cfg.predownload,
                validate_hash=cfg.validate_hash,
                download_timeout=cfg.download_timeout,
                cache_limit=cfg.cache_limit,
                download_retry=1,
            )
            if local_leader:  # the leader registered the prefix: a dead run is known by it
                record_owner(streaming_compat.registered_prefix(dataset))
    except BaseException as err:
        # the prefix walk's handles, and what a failed construction made
        streaming_compat.release_handles(opened)
        if not isinstance(err, Exception):
            raise
        if "Reused local directory" in str(err):
            raise DataError(
                f"local cache {cache_dir} is in use by another running loader; "
                "give each concurrent run its own DataConfig.local_cache"
            ) from err
        translated = translate_stream_error(err, cfg.remote, split, cache=cache_dir)
        if translated is err:
            raise
        raise translated from err
    # The prefix walk's handles on the segments of every prefix registered already (other
    # loaders', other jobs'): streaming never closes them.
    streaming_compat.release_handles(opened, keep=dataset)
    return dataset
