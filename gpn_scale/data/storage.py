"""A dataset root (a local directory or `s3://bucket/prefix`) as the data pipeline sees it,
on top of the one storage layer (gpn_scale.io: endpoint, credentials, retries and errors shared
with the checkpoints).

Streaming downloads shards by itself; this module serves what it does not: reading and
writing the metadata file, checking that an index exists before streaming starts (so that
the user gets one clear line instead of a retry storm), listing and deleting a split for
`--overwrite`, and fetching shards for `verify`. Failures are `DataError`s that say what went
wrong (credentials, endpoint, bucket, key).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from gpn_scale.data.errors import DataError
from gpn_scale.io import storage as io_storage
from gpn_scale.io.storage import is_s3, join

__all__ = ["Location", "is_s3", "join", "split_s3", "translate_s3_error"]

SUBJECT = "dataset root"


def split_s3(url: str) -> tuple[str, str]:
    """'s3://bucket/a/b' -> ('bucket', 'a/b')."""
    return io_storage.split_s3(url, error=DataError)


def translate_s3_error(err: BaseException, url: str, what: str = "read") -> DataError:
    """A one-line DataError for an S3 failure met outside gpn_scale.io (streaming's download
    and upload threads, which retry on their own)."""
    kind, detail = io_storage.classify(err)
    return DataError(io_storage.describe(kind, detail, url=url, what=what, subject=SUBJECT))


@dataclass(frozen=True)
class Location:
    """A dataset root (local directory or s3://bucket/prefix) with the few operations the
    pipeline needs. Paths given to methods are relative to the root, '/'-separated."""

    root: str

    @property
    def remote(self) -> bool:
        return is_s3(self.root)

    def url(self, rel: str = "") -> str:
        return join(self.root, rel) if rel else self.root

    @cached_property
    def storage(self) -> io_storage.Storage:
        if self.remote:
            split_s3(self.root)  # the data pipeline's message for s3:// without a bucket
        return io_storage.open_storage(self.root, error=DataError, subject=SUBJECT)

    def read_bytes(self, rel: str) -> bytes:
        data = self.storage.get_bytes(rel.strip("/"))
        if data is None:
            raise DataError(f"{self.url(rel)}: file not found; check the path")
        return data

    def exists(self, rel: str) -> bool:
        return self.storage.exists(rel.strip("/"))

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.storage.put_bytes(rel.strip("/"), data)  # atomic: readers never see half a file

    def list(self, rel: str = "") -> Iterator[str]:
        """Relative names of all files under `rel` (recursive), sorted."""
        prefix = rel.strip("/") + "/" if rel.strip("/") else ""
        return iter(sorted(self.storage.list(prefix)))

    def delete_tree(self, rel: str) -> int:
        """Delete every file under `rel`; returns how many were deleted."""
        names = list(self.list(rel))
        if not self.remote and Path(self.url(rel)).is_file():
            self.storage.delete(rel.strip("/"))
            return 1
        self.storage.delete_prefix(rel.strip("/") + "/")
        return len(names)

    def delete(self, rel: str) -> None:
        self.storage.delete(rel.strip("/"))
