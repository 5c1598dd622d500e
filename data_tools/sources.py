"""Documents from local text files, JSONL (a chosen field), Parquet (a chosen column;
FineWeb-Edu's layout is a `text` column) or a Hugging Face dataset (needs internet and
the `datasets` package). Inputs are read in a fixed, sorted order so builds repeat."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO

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


ENCODING_ERRORS = ("strict", "replace")


def _decode(raw: bytes, path: str, errors: str, offset: int = 0, line: int | None = None) -> str:
    """UTF-8 text of `raw` (at byte `offset` of the file); a byte that is not UTF-8 is one
    DataError naming the file and its offset, unless `errors` is "replace" (U+FFFD)."""
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        at = f"{path}:{line}" if line is not None else path
        raise DataError(
            f"{at}: not UTF-8 text (byte 0x{raw[err.start]:02x} at byte offset "
            f"{offset + err.start}); convert the file to UTF-8 (e.g. iconv -t UTF-8), or pass "
            "--encoding-errors replace to read such bytes as U+FFFD"
        ) from None


def _open_bytes(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _read_text(path: str, errors: str) -> str:
    """The whole file as text, line ends as text mode reads them (\r\n and \r -> \n)."""
    with _open_bytes(path) as fh:
        text = _decode(fh.read(), path, errors)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _iter_jsonl(path: str, field: str, errors: str = "strict") -> Iterator[str]:
    offset = 0
    with _open_bytes(path) as fh:
        for lineno, raw in enumerate(fh, 1):
            line = _decode(raw, path, errors, offset, lineno)
            offset += len(raw)
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
    encoding_errors: str = "strict",
) -> Iterator[str]:
    """Every document of every input, in order (a text file is one document). Text and
    JSONL files must be UTF-8: a byte that is not is refused in one line naming the file
    and its offset, unless `encoding_errors="replace"` (read as U+FFFD)."""
    if encoding_errors not in ENCODING_ERRORS:
        raise DataError(
            f"--encoding-errors {encoding_errors!r}: choose one of {', '.join(ENCODING_ERRORS)}"
        )
    count = 0
    for path, kind in files:
        if kind == "text":
            docs: Iterator[str] = iter([_read_text(path, encoding_errors)])
        elif kind == "jsonl":
            docs = _iter_jsonl(path, field, encoding_errors)
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
