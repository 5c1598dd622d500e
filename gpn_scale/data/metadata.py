"""Dataset metadata: what a dataset root holds, stored as `gpn_dataset.json` beside the
`train/` and `val/` MDS splits, and the check that a model can train on it.

The file is written last by `gpn-data build`, so a root without it is either not a
gpn-data dataset or an interrupted build; readers refuse both.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from gpn_scale.data.errors import DataError
from gpn_scale.data.storage import Location

METADATA_FILE = "gpn_dataset.json"
FORMAT = "gpn-mds-v1"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class SplitInfo:
    samples: int  # windows of seq_len tokens
    tokens: int  # samples * seq_len
    shards: int


@dataclass(frozen=True)
class DatasetMetadata:
    """Everything a trainer or a reader of results needs to know about a dataset root."""

    vocab_size: int  # ids are in [0, vocab_size)
    seq_len: int  # tokens per stored window
    tokenizer: dict[str, Any]  # kind, name, sha256 of its serialisation, eod token
    eod_token_id: int
    splits: dict[str, SplitInfo]
    source: dict[str, Any]  # description, inputs, documents
    seed: int  # window shuffle seed used by the build
    token_dtype: str = "uint16"
    val_fraction: float = 0.0
    total_tokens: int = 0  # tokens after tokenisation (EOD included)
    dropped_tokens: int = 0  # tail shorter than one window
    format: str = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    def tokens(self, split: str) -> int:
        return self.splits[split].tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @property
    def fingerprint(self) -> str:
        """Short hash identifying this exact dataset (loader states carry it)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "metadata") -> DatasetMetadata:
        if data.get("format") != FORMAT:
            raise DataError(
                f"{where}: unknown dataset format {data.get('format')!r} (expected "
                f"{FORMAT!r}); rebuild the dataset with this version of gpn-data"
            )
        try:
            splits = {name: SplitInfo(**info) for name, info in data["splits"].items()}
            known = {f for f in cls.__dataclass_fields__}
            return cls(
                **{k: v for k, v in data.items() if k in known and k != "splits"}, splits=splits
            )
        except (KeyError, TypeError) as err:
            raise DataError(
                f"{where}: malformed dataset metadata ({err}); rebuild the dataset"
            ) from None


def read_metadata(remote: str) -> DatasetMetadata:
    """Read `gpn_dataset.json` from a dataset root (local directory or s3://bucket/prefix)."""
    location = Location(str(remote))
    url = location.url(METADATA_FILE)
    if not location.remote and not os.path.isdir(location.url()):
        what = "is a file, not a directory" if os.path.exists(location.url()) else "is missing"
        raise DataError(
            f"dataset directory {location.url()} {what}; point data.remote (or "
            "the dataset path given) at a root written by `gpn-data build`"
        )
    if not location.exists(METADATA_FILE):
        raise DataError(
            f"{url}: no dataset metadata; point at a dataset root written by "
            "`gpn-data build` (an interrupted build leaves none: rebuild with "
            "--overwrite)"
        )
    try:
        data = json.loads(location.read_bytes(METADATA_FILE))
    except json.JSONDecodeError as err:
        raise DataError(
            f"{url}: metadata is not valid JSON ({err.msg}); rebuild the dataset"
        ) from None
    return DatasetMetadata.from_dict(data, where=url)


def write_metadata(remote: str, meta: DatasetMetadata) -> None:
    Location(str(remote)).write_bytes(METADATA_FILE, meta.to_json().encode())


def check_compatible(
    meta: DatasetMetadata, *, vocab_size: int | None = None, seq_len: int | None = None
) -> None:
    """Raise DataError unless a model with (vocab_size, seq_len) can train on `meta`.

    Rule: the model's vocabulary must cover every id the dataset can hold
    (model vocab_size >= dataset vocab_size; a larger, e.g. padded, model vocabulary is
    fine), and seq_len must match exactly (windows are stored at a fixed length).
    """
    if vocab_size is not None and vocab_size < meta.vocab_size:
        raise DataError(
            f"vocab mismatch: the dataset's tokenizer ({meta.tokenizer.get('name')}) has "
            f"vocab_size {meta.vocab_size} but the model has vocab_size {vocab_size}; set the "
            f"model's vocab_size >= {meta.vocab_size} or rebuild the data with a smaller "
            "tokenizer"
        )
    if seq_len is not None and seq_len != meta.seq_len:
        raise DataError(
            f"seq_len mismatch: the dataset stores windows of {meta.seq_len} tokens but the "
            f"run asks for seq_len {seq_len}; set seq_len {meta.seq_len} or rebuild the data "
            f"with --seq-len {seq_len}"
        )
