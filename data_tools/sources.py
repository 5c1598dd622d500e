"""Documents from local text files, JSONL (a chosen field), Parquet (a chosen column;
FineWeb-Edu's layout is a `text` column) or a Hugging Face dataset (needs internet and
the `datasets` package). Inputs are read in a fixed, sorted order so builds repeat."""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path

from gpn_scale.data.errors import DataError

FORMATS = ("auto", "text", "jsonl", "parquet", "hf")
_EXT = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".rst": "text",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
}


def _format_of(path: Path, fmt: str) -> str | None:
    if fmt != "auto":
        return fmt
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return _EXT.get(Path(name).suffix.lower())


def expand_inputs(inputs: list[str], fmt: str = "auto") -> list[tuple[str, str]]:
    """(path, format) for every file, directories expanded recursively in sorted order."""
    if fmt not in FORMATS:
        raise DataError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt == "hf":
        return [(name, "hf") for name in inputs]
    files: list[tuple[str, str]] = []
    for item in inputs:
        if item.startswith("hf:"):
            files.append((item[3:], "hf"))
            continue
        path = Path(item).expanduser()
        if path.is_dir():
            found = [
                (str(p), f)
                for p in sorted(path.rglob("*"))
                if p.is_file() and (f := _format_of(p, fmt))
            ]
            if not found:
                raise DataError(
                    f"{path}: no .txt/.md/.jsonl/.parquet files inside; pass "
                    "files, or --format to read other extensions"
                )
            files.extend(found)
        elif path.is_file():
            kind = _format_of(path, fmt)
            if kind is None:
                raise DataError(
                    f"{path}: cannot tell the format from the extension; pass "
                    "--format text|jsonl|parquet"
                )
            files.append((str(path), kind))
        else:
            raise DataError(
                f"{item}: no such file or directory (use hf:NAME for a Hugging Face dataset)"
            )
    return files


def _open_text(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _iter_jsonl(path: str, field: str) -> Iterator[str]:
    with _open_text(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path}:{lineno}: not valid JSON ({err.msg}); fix the line or remove it"
                ) from None
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(
                    f"{path}:{lineno}: no field {field!r} (has {keys}); pass "
                    "--field with the text field's name"
                )
            value = record[field]
            if isinstance(value, str) and value:
                yield value


def _iter_parquet(path: str, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if field not in parquet.schema_arrow.names:
        raise DataError(
            f"{path}: no column {field!r} (has {parquet.schema_arrow.names}); "
            "pass --field with the text column's name"
        )
    for batch in parquet.iter_batches(columns=[field], batch_size=4096):
        for value in batch.column(0).to_pylist():
            if isinstance(value, str) and value:
                yield value


def _iter_hf(name: str, field: str, split: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "reading a Hugging Face dataset needs the `datasets` package; "
            "pip install datasets (or download the Parquet files and pass "
            "them)"
        ) from None
    config = None
    if ":" in name:
        name, config = name.split(":", 1)
    try:
        data = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as err:  # noqa: BLE001 - offline, unknown name
        raise DataError(
            f"Hugging Face dataset {name!r} could not be opened "
            f"({type(err).__name__}: {err}); check the name and the network, or "
            "pass local Parquet files"
        ) from None
    for record in data:
        value = record.get(field)
        if isinstance(value, str) and value:
            yield value


def iter_documents(
    files: list[tuple[str, str]],
    *,
    field: str = "text",
    hf_split: str = "train",
    max_docs: int | None = None,
) -> Iterator[str]:
    """Every document of every input, in order (a text file is one document)."""
    count = 0
    for path, kind in files:
        if kind == "text":
            with _open_text(path) as fh:
                docs: Iterator[str] = iter([fh.read()])
        elif kind == "jsonl":
            docs = _iter_jsonl(path, field)
        elif kind == "parquet":
            docs = _iter_parquet(path, field)
        else:
            docs = _iter_hf(path, field, hf_split)
        for doc in docs:
            if not doc:
                continue
            yield doc
            count += 1
            if max_docs is not None and count >= max_docs:
                return
