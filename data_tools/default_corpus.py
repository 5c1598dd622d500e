"""The embedded default corpus: real English text every Python installation carries.

Sources, in this fixed order: the Python reference documentation shipped as
`pydoc_data.topics` (the text `help()` shows), then module/class/function docstrings of
the standard library's own .py files (sorted paths, tests excluded), until `max_bytes`.
Same Python version -> same bytes -> same shards; the corpus's sha256 is stored in the
dataset metadata. Tokenised with the built-in byte-level tokenizer (vocab 257).
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from gpn_scale.data.errors import DataError

DEFAULT_MAX_BYTES = 3_000_000
MIN_DOC_CHARS = 200  # one-line docstrings are mostly noise
_SKIP_PARTS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "lib2to3",
    "turtledemo",
    "encodings",
}
DEFAULT_VAL_FRACTION = 0.02


def _topic_documents() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return
    for key in sorted(topics):
        text = topics[key].strip()
        if len(text) >= MIN_DOC_CHARS:
            yield text


def _docstring_documents() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if _SKIP_PARTS.intersection(path.relative_to(stdlib).parts):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node, clean=True)
                if text and len(text) >= MIN_DOC_CHARS:
                    yield text


def default_corpus_documents(max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """The corpus as a list of documents (deterministic for a given Python install)."""
    docs: list[str] = []
    total = 0
    seen: set[str] = set()
    for source in (_topic_documents(), _docstring_documents()):
        for text in source:
            if text in seen:  # inherited/duplicated docstrings
                continue
            seen.add(text)
            docs.append(text)
            total += len(text.encode("utf-8"))
            if total >= max_bytes:
                return docs
    if not docs:
        raise DataError(
            "this Python installation ships no documentation text (no pydoc_data, "
            "no stdlib sources); build a dataset from your own text with "
            "`gpn-data build`"
        )
    return docs


def corpus_sha256(docs: list[str]) -> str:
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(doc.encode("utf-8"))
        digest.update(b"\x00")
    return digest.hexdigest()


def build_default_dataset(
    out: str,
    *,
    seq_len: int = 256,
    seed: int = 0,
    overwrite: bool = False,
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = False,
) -> str:
    """Build (or reuse) the default dataset at `out`; returns the dataset root.

    If `out` already holds the same default dataset (same corpus hash, seq_len and seed)
    it is reused as is; any other dataset there is an error unless `overwrite`.
    Call it from one process (e.g. rank 0, then a barrier): two concurrent builds into
    the same `out` would interleave their files.
    """
    import platform

    from data_tools.build import BuildOptions, build_dataset
    from data_tools.tokenizer import resolve_tokenizer
    from gpn_scale.data.metadata import METADATA_FILE, read_metadata
    from gpn_scale.data.storage import Location

    docs = default_corpus_documents(max_bytes)
    digest = corpus_sha256(docs)
    if not overwrite and Location(out).exists(METADATA_FILE):
        meta = read_metadata(out)
        if meta.source.get("sha256") == digest and meta.seq_len == seq_len and meta.seed == seed:
            return out
    source = {
        "description": f"embedded default corpus: Python {platform.python_version()} "
        "reference topics + stdlib docstrings",
        "kind": "default-corpus",
        "sha256": digest,
        "bytes": sum(len(d.encode()) for d in docs),
    }
    options = BuildOptions(
        seq_len=seq_len,
        seed=seed,
        val_fraction=DEFAULT_VAL_FRACTION,
        overwrite=overwrite,
        progress=progress,
        shard_size="8mb",
        docs_per_task=256,
    )
    build_dataset(docs, out, resolve_tokenizer("byte"), options, source)
    return out
