"""Megatron indexed datasets (`.bin` + `.idx`, what Megatron-LM's preprocess_data.py writes) as
the token stream of a build, read through megatron-core's own reader
(`megatron.core.datasets.indexed_dataset.IndexedDataset`, CPU-only, no Apex or Transformer
Engine needed).

The corpus is already tokenised, so the build skips the tokenizer's encoding: every document
(the sequences between two `document_indices` entries; a document of several sentences is
kept whole) is copied in order, prefixes in the order given (a folder's in sorted order),
followed by the end-of-document id as `--megatron-eod` says:

  auto    (default) every document ends with exactly one EOD: appended where the document
          does not already end with it (corpora made with and without `--append-eod` alike)
  append  always appended, even after a document that ends with it
  none    nothing appended (the documents are taken as they are)

Every id is checked against the tokenizer's vocabulary before anything is written: the
tokenizer given with `--tokenizer` must be the one the corpus was made with (its vocabulary
size and EOD id go into the dataset's metadata). Empty documents are skipped, as the text
path skips empty texts.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gpn_scale.data.errors import DataError

EOD_MODES = ("auto", "append", "none")
# Documents per read: one contiguous read of the .bin per batch (the preprocess writes a
# document's sequences back to back), EOD inserted with numpy.
DOCS_PER_READ = 4096


def _indexed_dataset_module() -> Any:
    """megatron-core's reader, imported without the warnings its package prints on a machine
    without Transformer Engine or Apex (irrelevant to reading tokens)."""
    torch_logger = logging.getLogger("torch.utils.cpp_extension")
    level = torch_logger.level
    torch_logger.setLevel(logging.ERROR)  # "No CUDA runtime is found" from torch's import
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
    except ImportError as err:
        raise DataError(
            f"--format megatron needs megatron-core ({err}); pip install megatron-core==0.16.1"
        ) from None
    finally:
        torch_logger.setLevel(level)
    return indexed_dataset


def expand_prefixes(inputs: list[str]) -> list[str]:
    """Each input as a Megatron path prefix: PREFIX (with PREFIX.bin and PREFIX.idx),
    PREFIX.bin or PREFIX.idx, or a folder (every `*.idx` with its `.bin`, sorted, recursed)."""
    prefixes: list[str] = []
    for item in inputs:
        if item.startswith(("s3://", "hf:")):
            raise DataError(
                f"{item}: --format megatron reads local .bin/.idx files; copy the corpus to a "
                "local or shared disk first"
            )
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(p.with_suffix("") for p in path.rglob("*.idx") if p.is_file())
            if not found:
                raise DataError(
                    f"{path}: no Megatron .idx files inside; pass a .bin/.idx prefix or a "
                    "folder holding them"
                )
            prefixes.extend(str(p) for p in found)
            continue
        if path.suffix in (".bin", ".idx"):
            path = path.with_suffix("")
        prefixes.append(str(path))
    for prefix in prefixes:
        missing = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
        if missing:
            raise DataError(
                f"{prefix}: no {' or '.join(prefix + s for s in missing)}; a Megatron "
                "corpus is a PREFIX.bin + PREFIX.idx pair (pass PREFIX)"
            )
    return list(dict.fromkeys(prefixes))


def open_indexed(prefix: str) -> Any:
    module = _indexed_dataset_module()
    try:
        return module.IndexedDataset(prefix, multimodal=False, mmap=True)
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file: asserts, struct errors
        first = " ".join(str(err).split()) or type(err).__name__
        raise DataError(
            f"{prefix}.idx/.bin: not a readable Megatron indexed dataset ({first}); check "
            "that both files are complete and come from the same preprocessing run"
        ) from None


def _doc_sizes(ds: Any) -> np.ndarray:
    """Token count of every document of `ds`."""
    doc_idx = np.asarray(ds.document_indices, dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(np.asarray(ds.sequence_lengths, dtype=np.int64))])
    return cum[doc_idx[1:]] - cum[doc_idx[:-1]]


def _first_documents(sizes: np.ndarray, left: int | None) -> int:
    """How many leading documents hold the first `left` non-empty ones (all when None)."""
    nonempty = np.flatnonzero(sizes > 0)
    if left is None or len(nonempty) <= left:
        return len(sizes)
    return int(nonempty[left - 1]) + 1 if left > 0 else 0


def _batches(
    ds: Any, prefix: str, vocab_size: int, eod_id: int, mode: str, n_docs: int
) -> Iterator[tuple[np.ndarray, int, int]]:
    """(tokens with EOD as configured, non-empty documents, EOD appended) per batch of the
    first `n_docs` documents; an id outside the vocabulary stops it with one line."""
    doc_idx = np.asarray(ds.document_indices, dtype=np.int64)
    sizes = _doc_sizes(ds)
    for lo in range(0, n_docs, DOCS_PER_READ):
        hi = min(lo + DOCS_PER_READ, n_docs)
        keep = sizes[lo:hi] > 0
        if not keep.any():
            continue
        seq_lo, seq_hi = int(doc_idx[lo]), int(doc_idx[hi])
        flat = np.concatenate(ds[seq_lo:seq_hi]).astype(np.int64, copy=False)
        lo_id, hi_id = int(flat.min()), int(flat.max())
        if hi_id >= vocab_size or lo_id < 0:
            bad = hi_id if hi_id >= vocab_size else lo_id
            raise DataError(
                f"{prefix}.bin: token id {bad} is outside the tokenizer's vocabulary "
                f"(0..{vocab_size - 1}); pass the tokenizer the corpus was made with "
                "(--tokenizer)"
            )
        ends = np.cumsum(sizes[lo:hi])[keep]  # exclusive end of each kept document in `flat`
        if mode == "none":
            yield flat, int(keep.sum()), 0
            continue
        need = np.ones(len(ends), dtype=bool) if mode == "append" else flat[ends - 1] != eod_id
        yield np.insert(flat, ends[need], eod_id), int(keep.sum()), int(need.sum())


def write_tokens(
    prefixes: list[str],
    path: str,
    *,
    dtype: np.dtype,
    vocab_size: int,
    eod_id: int,
    mode: str = "auto",
    max_docs: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """The corpus, EOD as configured, into the flat scratch file of a build (`dtype`; every
    id checked against `vocab_size` first). Returns the counts: documents, tokens (written,
    EOD included), corpus_tokens (as read), eod_appended, empty_documents, and per prefix."""
    if mode not in EOD_MODES:
        raise DataError(f"--megatron-eod {mode!r}: choose one of {', '.join(EOD_MODES)}")
    if not 0 <= eod_id < vocab_size:
        raise DataError(
            f"end-of-document id {eod_id} is outside the vocabulary (0..{vocab_size - 1}); "
            "pass --eod-token with one of the tokenizer's special tokens"
        )
    counts: dict[str, Any] = {
        "documents": 0,
        "tokens": 0,
        "corpus_tokens": 0,
        "eod_appended": 0,
        "empty_documents": 0,
        "prefixes": [],
    }
    left = max_docs
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="read megatron", unit=" doc", dynamic_ncols=True)
    with open(path, "wb") as out, contextlib.ExitStack() as stack:
        if bar is not None:
            stack.callback(bar.close)
        for prefix in prefixes:
            if left is not None and left <= 0:
                break
            ds = open_indexed(prefix)
            sizes = _doc_sizes(ds)
            n = _first_documents(sizes, left)
            docs = tokens = 0
            for chunk, kept, added in _batches(ds, prefix, vocab_size, eod_id, mode, n):
                out.write(chunk.astype(dtype, copy=False).tobytes())
                docs += kept
                tokens += len(chunk)
                counts["eod_appended"] += added
                if bar is not None:
                    bar.update(kept)
            counts["documents"] += docs
            counts["tokens"] += tokens
            counts["corpus_tokens"] += int(sizes[:n].sum())
            counts["empty_documents"] += int(n - docs)
            counts["prefixes"].append(
                {
                    "prefix": prefix,
                    "documents": docs,
                    "tokens": int(sizes[:n].sum()),
                    "dtype": np.dtype(ds.index.dtype).name,
                }
            )
            if left is not None:
                left -= docs
            del ds
    return counts
