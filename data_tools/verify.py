"""`inspect` and `verify`: read a dataset root's metadata, re-hash every shard against
its split's index.json, and report bad shards by name."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from gpn_scale.data.errors import DataError
from gpn_scale.data.metadata import DatasetMetadata, read_metadata
from gpn_scale.data.storage import Location
from gpn_scale.data.streaming_import import import_streaming


@dataclass
class VerifyReport:
    root: str
    checked: int = 0
    bad: list[str] = field(default_factory=list)  # "split/basename: why"
    problems: list[str] = field(default_factory=list)  # metadata/index disagreements

    @property
    def ok(self) -> bool:
        return not self.bad and not self.problems


def _read_index(location: Location, split: str) -> dict[str, Any]:
    rel = f"{split}/index.json"
    if not location.exists(rel):
        raise DataError(
            f"{location.url(rel)}: missing index; the split was deleted or the "
            "build was interrupted: rebuild with --overwrite"
        )
    try:
        return json.loads(location.read_bytes(rel))
    except json.JSONDecodeError as err:
        raise DataError(
            f"{location.url(rel)}: index is not valid JSON ({err.msg}); rebuild with --overwrite"
        ) from None


def verify_dataset(root: str, progress: bool = True) -> VerifyReport:
    """Re-download and re-hash every shard file of every split."""
    import_streaming()  # without transformers (gpn_scale/data/streaming_import.py)
    from streaming.base.hashing import get_hash

    location = Location(root)
    meta = read_metadata(root)
    report = VerifyReport(root=root)
    jobs: list[tuple[str, dict[str, Any]]] = []
    for split, info in meta.splits.items():
        index = _read_index(location, split)
        samples = sum(int(s.get("samples", 0)) for s in index.get("shards", []))
        if samples != info.samples:
            report.problems.append(
                f"{split}: index holds {samples} samples, metadata says {info.samples}"
            )
        if len(index.get("shards", [])) != info.shards:
            report.problems.append(
                f"{split}: index lists {len(index.get('shards', []))} "
                f"shards, metadata says {info.shards}"
            )
        for shard in index.get("shards", []):
            stored = shard.get("zip_data") or shard["raw_data"]
            jobs.append((split, stored))
    iterator: Any = jobs
    if progress:
        from tqdm import tqdm

        iterator = tqdm(jobs, file=sys.stderr, desc="verify", unit=" shard")
    for split, stored in iterator:
        name = f"{split}/{stored['basename']}"
        report.checked += 1
        try:
            data = location.read_bytes(name)
        except DataError:
            report.bad.append(f"{name}: missing")
            continue
        if len(data) != int(stored["bytes"]):
            report.bad.append(f"{name}: size {len(data)} != {stored['bytes']} in the index")
            continue
        for algo, expected in sorted(stored.get("hashes", {}).items()):
            if get_hash(algo, data) != expected:
                report.bad.append(f"{name}: {algo} mismatch")
                break
        else:
            if not stored.get("hashes"):
                report.problems.append(f"{name}: the index records no hashes")
    return report


def describe(meta: DatasetMetadata, root: str) -> str:
    """Human-readable summary printed by `inspect`."""
    tok = meta.tokenizer
    lines = [
        f"dataset      {root}",
        f"tokenizer    {tok.get('kind')}:{tok.get('name')} (sha256 {str(tok.get('sha256'))[:12]})",
        f"vocab_size   {meta.vocab_size}   eod_token_id {meta.eod_token_id}   "
        f"dtype {meta.token_dtype}",
        f"seq_len      {meta.seq_len}   seed {meta.seed}   val_fraction {meta.val_fraction:g}",
        f"source       {meta.source.get('description', '?')}  "
        f"({meta.source.get('documents', '?')} documents)",
        f"tokens       {meta.total_tokens:,} total, {meta.dropped_tokens:,} dropped tail",
    ]
    for split, info in meta.splits.items():
        lines.append(
            f"split {split:<6} {info.samples:,} windows, {info.tokens:,} tokens, "
            f"{info.shards} shard(s)"
        )
    return "\n".join(lines)
