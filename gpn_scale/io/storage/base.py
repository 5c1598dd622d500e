"""The storage interface: keys relative to a root, what a listing says of a file, the
backends' common methods, the one-line error type and S3 URLs (see the package docstring)."""

from __future__ import annotations

import builtins
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ErrorType = Callable[[str], Exception]


class StorageError(Exception):
    """A storage failure; the message is one line naming the problem and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: message` of an exception, squeezed onto one line and cut to `limit` characters."""
    text = " ".join(str(exc).split()) or repr(exc)
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_s3(path: str) -> bool:
    return str(path).startswith("s3://")


def join(root: str, *parts: str) -> str:
    """Join path parts; for s3:// keep forward slashes and no duplicate separators."""
    if is_s3(root):
        out = root.rstrip("/")
        for part in parts:
            out += "/" + part.strip("/")
        return out
    return os.path.join(root, *parts)


def split_s3(url: str, error: ErrorType = StorageError) -> tuple[str, str]:
    """'s3://bucket/a/b' -> ('bucket', 'a/b')."""
    rest = str(url)[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise error(f"{url}: no bucket in the S3 URL; write it as s3://bucket/prefix")
    return bucket, key.strip("/")


def noun(subject: str) -> str:
    """'checkpoint' for 'checkpoint root' (for messages about files and directories under it)."""
    return subject.removesuffix(" root")


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing says about one stored file (cheap to get for many files at once)."""

    size: int
    etag: str | None = None  # S3 only: changes whenever the object is rewritten
    mtime_ns: int | None = None  # local only: changes whenever the file is rewritten


class Storage(ABC):
    """A flat key -> bytes store rooted at `uri`; keys use '/' separators."""

    uri: str

    def child_uri(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key}" if key else self.uri

    @abstractmethod
    def put_file(self, local_path: Path, key: str) -> ObjectInfo:
        """Store a local file under `key` (the local file may be moved away). Returns its info."""

    @abstractmethod
    def get_file(self, key: str, local_path: Path) -> None:
        """Copy `key` to `local_path`; the caller's error if it is missing."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object atomically (readers see the old or the new content, never half)."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes | None:
        """A small object's content, or None when it does not exist."""

    @abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        """(content, version) of a small object, or None when it does not exist; the version
        changes whenever the object is rewritten (for `put_if`)."""

    @abstractmethod
    def put_if(self, key: str, data: bytes, version: str | None) -> str | None:
        """Write a small object only if it is still at `version` (None: only if it does not
        exist), atomically with that check. The new version, or None when another writer
        changed it first (nothing written)."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether `key` exists (a missing S3 bucket is an error, not False)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one file; missing is fine."""

    @abstractmethod
    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        """All files under `prefix` (recursive): key relative to the root -> info."""

    @abstractmethod
    def list_dirs(self) -> builtins.list[str]:  # (`list` is a method in here)
        """Names of the immediate sub-directories of the root."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every file under `prefix` ('step_000000100/'); missing is fine."""

    @abstractmethod
    def preflight(self) -> None:
        """Cheaply prove that the root can be written; the caller's error naming the fix if not."""

    def local_dir(self, key: str) -> Path | None:
        """A directory readers can open directly (local storage), else None (download first)."""
        return None
