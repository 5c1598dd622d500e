"""text -> tokens -> fixed windows -> shuffled -> train/val MDS shards + metadata.

The recipe (the paper's): documents are tokenised with an end-of-document token after
each, concatenated, cut into non-overlapping windows of `seq_len` tokens (the tail that
does not fill a window is dropped), the windows are permuted with `seed`, and the last
bin of the permutation (`val_fraction` of the windows, or `val_windows`) is held out.

Scale: tokens go to a scratch file on local disk (uint16 for vocabularies <= 65536), not
to memory, so a 10B-token corpus needs ~20 GB of scratch and little RAM; windows are then
read back in permuted order into streaming's MDSWriter, which uploads finished shards
while the next are written.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from data_tools.tokenizer import Encoder, TokenizerSpec, encode_in_worker, init_worker
from gpn_scale.data.errors import DataError
from gpn_scale.data.metadata import METADATA_FILE, DatasetMetadata, SplitInfo, write_metadata
from gpn_scale.data.storage import Location, join, translate_s3_error
from gpn_scale.data.streaming_import import import_streaming

SHARD_HASHES = ["sha1", "xxh64"]  # streaming wants them sorted; xxh64 is the fast one


@dataclass
class BuildOptions:
    seq_len: int = 2048
    seed: int = 0
    val_fraction: float = 0.01
    val_windows: int | None = None
    workers: int = 1
    shard_size: str | int = "64mb"
    overwrite: bool = False
    scratch_dir: str | None = None
    progress: bool = True
    docs_per_task: int = 64
    extra: dict[str, Any] = field(default_factory=dict)


def _progress(iterable: Iterable[Any], enabled: bool, **kwargs: Any) -> Iterable[Any]:
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, **kwargs)


def existing_dataset_files(location: Location) -> list[str]:
    """What a build would replace: metadata and anything under train/ or val/."""
    found = [METADATA_FILE] if location.exists(METADATA_FILE) else []
    for split in ("train", "val"):
        found.extend(location.list(split))
    return found


def check_output(out: str, overwrite: bool) -> tuple[Location, list[str]]:
    """Refuse an --out that cannot be written (a file, a read-only or unwritable directory)
    or that holds a dataset (unless `overwrite`); deletes nothing. Returns the location and
    the files a build would replace."""
    location = Location(out)
    if not location.remote:
        from gpn_scale.io.outputs import check_out_dir

        check_out_dir(out, "--out", error=DataError)
    existing = existing_dataset_files(location)  # also checks bucket/credentials/endpoint
    if existing and not overwrite:
        raise DataError(
            f"{out} already holds a dataset ({len(existing)} files, e.g. "
            f"{existing[0]}); pass --overwrite to replace it or choose another "
            "--out"
        )
    return location, existing


def prepare_output(out: str, overwrite: bool) -> Location:
    """Refuse to write over a dataset unless asked; with overwrite, remove the old one
    (metadata first, so an interrupted rebuild is never mistaken for a complete one)."""
    location, existing = check_output(out, overwrite)
    if existing:
        location.delete(METADATA_FILE)
        for split in ("train", "val"):
            location.delete_tree(split)
    return location


def _batched(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenize_to_file(
    documents: Iterable[str],
    spec: TokenizerSpec,
    path: str,
    *,
    workers: int = 1,
    docs_per_task: int = 64,
    progress: bool = True,
    pool: Any = None,
) -> tuple[int, int]:
    """Tokenise documents (in order, EOD after each) into a flat binary file of
    `spec.dtype`. Returns (documents, tokens). `pool`: an already started pool made with
    `init_worker(spec)` (benchmarks use it to time the steady state); left running."""
    n_docs = n_tokens = 0
    batches = _batched(documents, docs_per_task)
    with open(path, "wb") as out:
        own_pool = None
        if pool is not None:
            results: Iterable[np.ndarray] = pool.imap(encode_in_worker, batches, chunksize=4)
        elif workers <= 1:
            encoder = Encoder(spec)
            results = (encoder.encode_documents(b) for b in batches)
        else:
            own_pool = start_pool(spec, workers)
            results = own_pool.imap(encode_in_worker, batches, chunksize=4)  # in input order
        try:
            bar = _progress(results, progress, desc="tokenise", unit=" batch")
            for tokens in bar:
                out.write(tokens.tobytes())
                n_tokens += len(tokens)
                n_docs += int(np.count_nonzero(tokens == spec.eod_token_id))
                if progress and hasattr(bar, "set_postfix_str"):
                    bar.set_postfix_str(f"{n_tokens:,} tokens", refresh=False)
        finally:
            if own_pool is not None:
                own_pool.terminate()
    return n_docs, n_tokens


def start_pool(spec: TokenizerSpec, workers: int) -> Any:
    """Tokeniser worker processes; spawn, not fork: the parent may hold a multithreaded
    Rust tokenizer, which does not survive a fork."""
    return multiprocessing.get_context("spawn").Pool(
        workers, initializer=init_worker, initargs=(spec,)
    )


def split_windows(
    n_windows: int, seed: int, val_fraction: float, val_windows: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Permute window indices with `seed`; the last bin is the held-out split.
    Returns (train_indices, val_indices), disjoint, together all windows."""
    if n_windows < 1:
        raise DataError(
            "the corpus is shorter than one window; give more text or a smaller --seq-len"
        )
    if val_windows is None:
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"--val-fraction {val_fraction}: must be in [0, 1)")
        val_windows = int(round(n_windows * val_fraction))
        if val_fraction > 0:
            val_windows = max(val_windows, 1)
    if not 0 <= val_windows < n_windows:
        raise DataError(
            f"--val-windows {val_windows}: the corpus has only {n_windows} windows "
            f"of this seq_len; hold out fewer (at most {n_windows - 1})"
        )
    order = np.random.default_rng(seed).permutation(n_windows)
    cut = n_windows - val_windows
    return order[:cut], order[cut:]


def write_split(
    out: str,
    split: str,
    tokens: np.ndarray,
    indices: np.ndarray,
    seq_len: int,
    dtype: np.dtype,
    shard_size: str | int,
    progress: bool,
) -> SplitInfo:
    """Write windows `indices` of the flat token array as one MDS split."""
    import_streaming()  # without transformers (gpn_scale/data/streaming_import.py)
    from streaming import MDSWriter

    columns = {"tokens": f"ndarray:{dtype.name}:{seq_len}"}
    url = join(out, split)
    shards = 0
    try:
        with MDSWriter(
            out=url,
            columns=columns,
            compression="zstd",
            hashes=SHARD_HASHES,
            size_limit=shard_size,
            exist_ok=True,
            max_workers=4,
        ) as writer:
            for index in _progress(indices, progress, desc=f"write {split}", unit=" window"):
                start = int(index) * seq_len
                writer.write({"tokens": np.ascontiguousarray(tokens[start : start + seq_len])})
        # after the `with`: finish() has flushed the last shard
        shards = len(getattr(writer, "shards", []))
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - upload failures arrive as botocore errors
        if type(err).__module__.startswith("botocore"):
            raise translate_s3_error(err, url, what="upload to") from err
        raise
    if not shards:
        import json

        shards = len(json.loads(Location(out).read_bytes(f"{split}/index.json"))["shards"])
    return SplitInfo(samples=len(indices), tokens=len(indices) * seq_len, shards=shards)


TokenWriter = Callable[[str], tuple[int, int, dict[str, Any]]]


def build_dataset(
    documents: Iterable[str],
    out: str,
    spec: TokenizerSpec,
    options: BuildOptions,
    source: dict[str, Any],
) -> DatasetMetadata:
    """The whole build from text; `documents` is consumed once. Returns the metadata written."""

    def tokenize(token_file: str) -> tuple[int, int, dict[str, Any]]:
        n_docs, n_tokens = tokenize_to_file(
            documents,
            spec,
            token_file,
            workers=options.workers,
            docs_per_task=options.docs_per_task,
            progress=options.progress,
        )
        return n_docs, n_tokens, {}

    return build_from_tokens(tokenize, out, spec, options, source)


def build_from_tokens(
    write_tokens: TokenWriter,
    out: str,
    spec: TokenizerSpec,
    options: BuildOptions,
    source: dict[str, Any],
) -> DatasetMetadata:
    """The build after tokenisation: `write_tokens(path)` fills the flat scratch file (ids of
    `spec.dtype`, EOD after each document) and returns (documents, tokens, facts for the
    source metadata); then the windows, shuffle, split, MDS shards and metadata. An existing
    dataset at `out` is replaced (with `overwrite`) only once the tokens and the split are
    known to be good, so a build that fails on its input loses nothing."""
    if options.seq_len < 1:
        raise DataError(f"--seq-len {options.seq_len}: must be >= 1")
    check_output(out, options.overwrite)
    scratch = tempfile.mkdtemp(prefix="gpn-data-build-", dir=options.scratch_dir)
    try:
        token_file = os.path.join(scratch, "tokens.bin")
        n_docs, n_tokens, facts = write_tokens(token_file)
        if n_docs == 0:
            raise DataError(
                "the inputs hold no documents (empty files or wrong --field); check the inputs"
            )
        n_windows = n_tokens // options.seq_len
        tokens = (
            np.memmap(token_file, dtype=spec.dtype, mode="r")
            if n_tokens
            else np.zeros(0, spec.dtype)
        )
        train_idx, val_idx = split_windows(
            n_windows, options.seed, options.val_fraction, options.val_windows
        )
        prepare_output(out, options.overwrite)  # the old dataset goes only now
        splits = {}
        for split, indices in (("train", train_idx), ("val", val_idx)):
            splits[split] = write_split(
                out,
                split,
                tokens,
                indices,
                options.seq_len,
                spec.dtype,
                options.shard_size,
                options.progress,
            )
        del tokens
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    meta = DatasetMetadata(
        vocab_size=spec.vocab_size,
        seq_len=options.seq_len,
        tokenizer=spec.identity(),
        eod_token_id=spec.eod_token_id,
        splits=splits,
        source={**source, **facts, "documents": n_docs},
        seed=options.seed,
        token_dtype=spec.dtype.name,
        val_fraction=float(
            options.val_fraction
            if options.val_windows is None
            else len(val_idx) / max(n_windows, 1)
        ),
        total_tokens=n_tokens,
        dropped_tokens=n_tokens - n_windows * options.seq_len,
        extra=dict(options.extra),
    )
    write_metadata(out, meta)  # last: its presence marks a complete dataset
    return meta
