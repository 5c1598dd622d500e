"""Where checkpoint files live: a local (or shared) directory, or an S3 prefix.

Both backends speak in *keys* relative to their root (`step_000000100/__0_0.distcp`), so the
checkpoint manager never builds paths or URLs itself. S3 goes through boto3/s3transfer
(multipart uploads via TransferConfig); botocore's own retries are switched off and replaced by
one bounded exponential-backoff loop here, so that the number of attempts and the delays are
known (and short in tests), and so that errors that will not go away by retrying (bad
credentials, a missing bucket) fail on the first attempt with a one-line message.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from gpn_scale.checkpoint.errors import CheckpointError, one_line

T = TypeVar("T")


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
        """Copy `key` to `local_path`; CheckpointError if it is missing."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object atomically (readers see the old or the new content, never half)."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes | None:
        """A small object's content, or None when it does not exist."""

    @abstractmethod
    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        """All files under `prefix` (recursive): key relative to the root -> info."""

    @abstractmethod
    def list_dirs(self) -> list[str]:
        """Names of the immediate sub-directories of the root."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every file under `prefix` ('step_000000100/'); missing is fine."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one file (e.g. 'DONE'); missing is fine."""

    @abstractmethod
    def preflight(self) -> None:
        """Cheaply prove that the root can be written; CheckpointError naming the fix if not."""

    def local_dir(self, key: str) -> Path | None:
        """A directory readers can open directly (local storage), else None (download first)."""
        return None


# --------------------------------------------------------------------------------------------
# Local directory (also a shared filesystem seen by all nodes)
# --------------------------------------------------------------------------------------------


class LocalStorage(Storage):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.abspath(os.path.expanduser(os.fspath(root))))
        self.uri = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / key if key else self.root

    def _fail(self, action: str, path: Path, exc: OSError) -> CheckpointError:
        if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            fix = "fix its permissions or choose a writable checkpoint root"
        elif exc.errno == errno.ENOSPC:
            fix = "free disk space or choose another checkpoint root"
        elif exc.errno == errno.ENOTDIR or isinstance(exc, FileExistsError):
            fix = "a file is in the way of the directory; choose another checkpoint root"
        else:
            fix = "check the checkpoint root"
        return CheckpointError(f"cannot {action} {path}: {one_line(exc)}; {fix}")

    def put_file(self, local_path: Path, key: str) -> ObjectInfo:
        dest = self._path(key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(local_path, dest)  # same filesystem: free and atomic
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
                shutil.copyfile(local_path, tmp)
                _fsync_file(tmp)
                os.replace(tmp, dest)
                os.unlink(local_path)
            st = dest.stat()
        except OSError as exc:
            raise self._fail("write checkpoint file", dest, exc) from exc
        return ObjectInfo(size=st.st_size, mtime_ns=st.st_mtime_ns)

    def get_file(self, key: str, local_path: Path) -> None:
        src = self._path(key)
        try:
            local_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, local_path)
        except FileNotFoundError as exc:
            raise CheckpointError(f"checkpoint file {src} is missing; the checkpoint is incomplete, pick another") from exc
        except OSError as exc:
            raise self._fail("read", src, exc) from exc

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self._path(key)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)  # atomic: readers never see half a manifest/pointer
            _fsync_dir(dest.parent)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._fail("write", dest, exc) from exc

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as exc:
            raise self._fail("read", self._path(key), exc) from exc

    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        base = self._path(prefix.rstrip("/"))
        out: dict[str, ObjectInfo] = {}
        if not base.is_dir():
            return out
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                p = Path(dirpath) / name
                try:
                    st = p.stat()
                except FileNotFoundError:  # deleted while listing
                    continue
                out[p.relative_to(self.root).as_posix()] = ObjectInfo(size=st.st_size, mtime_ns=st.st_mtime_ns)
        return out

    def list_dirs(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._fail("list", self.root, exc) from exc

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix.rstrip("/")), ignore_errors=True)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def preflight(self) -> None:
        probe = self.root / f".preflight-{uuid.uuid4().hex[:12]}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise self._fail("write to checkpoint directory", self.root, exc) from exc

    def local_dir(self, key: str) -> Path | None:
        return self._path(key.rstrip("/"))


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on directories
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# S3 (or any S3-compatible endpoint: S3_ENDPOINT_URL)
# --------------------------------------------------------------------------------------------

_AUTH_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
    "403",
}
_TRANSIENT_CODES = {
    "500",
    "502",
    "503",
    "504",
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}


class _NotFound(Exception):
    pass


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError as exc:
        raise CheckpointError(f"{name}={os.environ[name]!r} is not a number; unset it or give a number") from exc


class S3Storage(Storage):
    """s3://bucket/prefix through boto3.

    Endpoint: S3_ENDPOINT_URL (or AWS_ENDPOINT_URL) when set, else AWS. Credentials: the normal
    boto3 chain (env, profile, instance role). `retries` attempts per request (env
    GPN_S3_RETRIES, default 5) with delays backoff_s * 2**i capped at 8 s (env GPN_S3_BACKOFF_S,
    default 0.5). Multipart threshold/chunk: GPN_S3_MULTIPART_MB (default 64).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        retries: int | None = None,
        backoff_s: float | None = None,
        multipart_mb: float | None = None,
    ) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        if not bucket:
            raise CheckpointError("S3 URI has no bucket; write it as s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.retries = max(1, int(retries if retries is not None else _env_float("GPN_S3_RETRIES", 5)))
        self.backoff_s = backoff_s if backoff_s is not None else _env_float("GPN_S3_BACKOFF_S", 0.5)
        self.endpoint = os.environ.get("S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL") or None
        mb = multipart_mb if multipart_mb is not None else _env_float("GPN_S3_MULTIPART_MB", 64)
        chunk = max(5 * 1024 * 1024, int(mb * 1024 * 1024))  # S3's minimum part size is 5 MiB
        self.transfer_config = TransferConfig(
            multipart_threshold=chunk, multipart_chunksize=chunk, max_concurrency=4, num_download_attempts=1
        )
        region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"
        config = Config(
            # One attempt per botocore call: the retry loop in _call owns retries and backoff.
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=_env_float("GPN_S3_CONNECT_TIMEOUT_S", 5),
            read_timeout=_env_float("GPN_S3_READ_TIMEOUT_S", 60),
            s3={"addressing_style": "path"} if self.endpoint else {},
        )
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=region, config=config
        )

    # -- error handling -----------------------------------------------------------------------

    def _where(self) -> str:
        return f"{self.uri} (endpoint {self.endpoint or 'AWS default'})"

    def _classify(self, exc: BaseException) -> tuple[str, str]:
        """('auth'|'bucket'|'notfound'|'transient'|'fatal', detail) for an exception chain."""
        from botocore import exceptions as bexc

        seen: BaseException | None = exc
        chain: list[BaseException] = []
        while seen is not None and len(chain) < 8:
            chain.append(seen)
            seen = seen.__cause__ or seen.__context__
        for e in chain:
            if isinstance(e, (bexc.NoCredentialsError, bexc.PartialCredentialsError)):
                return "nocreds", one_line(e)
            if isinstance(e, bexc.ClientError):
                code = str(e.response.get("Error", {}).get("Code", ""))
                status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
                if code == "NoSuchBucket":
                    return "bucket", one_line(e)
                if code in _AUTH_CODES or status == "403":
                    return "auth", one_line(e)
                if code in _NOT_FOUND_CODES:
                    return "notfound", one_line(e)
                if code in _TRANSIENT_CODES or status.startswith("5"):
                    return "transient", one_line(e)
                return "fatal", one_line(e)
            if isinstance(
                e,
                (
                    bexc.EndpointConnectionError,
                    bexc.ConnectionClosedError,
                    bexc.ConnectTimeoutError,
                    bexc.ReadTimeoutError,
                    bexc.HTTPClientError,
                    ConnectionError,
                    TimeoutError,
                ),
            ):
                return "transient", one_line(e)
        # boto3's S3UploadFailedError keeps only the text of the ClientError it wraps.
        text = one_line(exc)
        if "NoSuchBucket" in text:
            return "bucket", text
        if any(code in text for code in _AUTH_CODES if not code.isdigit()):
            return "auth", text
        if any(word in text for word in ("Could not connect", "Connection was closed", "timed out", "Max retries")):
            return "transient", text
        if type(exc).__name__ == "RetriesExceededError":  # s3transfer download retries
            return "transient", text
        return "fatal", text

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one S3 request with bounded exponential backoff on transient errors only."""
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below, re-raised as CheckpointError
                kind, detail = self._classify(exc)
                if kind == "notfound":
                    raise _NotFound(detail) from exc
                if kind == "nocreds":
                    raise CheckpointError(
                        f"no S3 credentials for {self.uri} while trying to {what}: set AWS_ACCESS_KEY_ID and "
                        "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / an instance role)"
                    ) from exc
                if kind == "auth":
                    raise CheckpointError(
                        f"S3 refused the credentials for {self._where()} while trying to {what} ({detail}); "
                        "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's permissions"
                    ) from exc
                if kind == "bucket":
                    raise CheckpointError(
                        f"S3 bucket '{self.bucket}' does not exist at {self._where()}; create it or fix the "
                        "checkpoint root (and S3_ENDPOINT_URL)"
                    ) from exc
                if kind == "fatal":
                    raise CheckpointError(f"S3 error for {self._where()} while trying to {what}: {detail}") from exc
                if attempt == self.retries:
                    raise CheckpointError(
                        f"S3 unreachable: could not {what} at {self._where()} after {self.retries} attempts "
                        f"({detail}); check S3_ENDPOINT_URL and the network, then resume"
                    ) from exc
                time.sleep(min(delay, 8.0))
                delay *= 2
        raise AssertionError("unreachable")

    # -- operations ---------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_file(self, local_path: Path, key: str) -> ObjectInfo:
        full = self._key(key)
        self._call(
            f"upload {key}",
            lambda: self.client.upload_file(str(local_path), self.bucket, full, Config=self.transfer_config),
        )
        return ObjectInfo(size=local_path.stat().st_size)

    def get_file(self, key: str, local_path: Path) -> None:
        local_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = local_path.with_name(f".{local_path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self._call(
                f"download {key}",
                lambda: self.client.download_file(self.bucket, self._key(key), str(tmp), Config=self.transfer_config),
            )
            os.replace(tmp, local_path)
        except _NotFound as exc:
            raise CheckpointError(
                f"checkpoint file {self.child_uri(key)} is missing; the checkpoint is incomplete, pick another"
            ) from exc
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        # A single PUT replaces an S3 object atomically.
        self._call(f"write {key}", lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data))

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self._call(
                f"read {key}",
                lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read(),
            )
        except _NotFound:
            return None

    def _list_raw(self, prefix: str, delimiter: str | None) -> list[dict[str, Any]]:
        def run() -> list[dict[str, Any]]:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = delimiter
            return list(self.client.get_paginator("list_objects_v2").paginate(**kwargs))

        try:
            return self._call(f"list {prefix or '/'}", run)
        except _NotFound as exc:  # NoSuchKey never comes from a listing; keep the message sane
            raise CheckpointError(f"cannot list {self._where()}: {exc}; check the checkpoint root") from exc

    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        base = self._key(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        out: dict[str, ObjectInfo] = {}
        for page in self._list_raw(base, None):
            for obj in page.get("Contents", []):
                out[obj["Key"][strip:]] = ObjectInfo(size=int(obj["Size"]), etag=str(obj.get("ETag", "")).strip('"'))
        return out

    def list_dirs(self) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        names: set[str] = set()
        for page in self._list_raw(base, "/"):
            for cp in page.get("CommonPrefixes", []):
                names.add(cp["Prefix"][len(base) :].rstrip("/"))
        return sorted(names)

    def delete_prefix(self, prefix: str) -> None:
        keys = [self._key(k) for k in self.list(prefix.rstrip("/") + "/")]
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            self._call(f"delete {prefix}", lambda b=batch: self.client.delete_objects(Bucket=self.bucket, Delete=b))

    def delete(self, key: str) -> None:
        self._call(f"delete {key}", lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key)))

    def preflight(self) -> None:
        probe = self._key(f".preflight-{uuid.uuid4().hex[:12]}")
        self._call("write a probe object", lambda: self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"ok"))
        self._call("delete a probe object", lambda: self.client.delete_object(Bucket=self.bucket, Key=probe))


def open_storage(uri: str, **s3_options: Any) -> Storage:
    """LocalStorage for a path (or file://path), S3Storage for s3://bucket/prefix.

    `s3_options` (retries, backoff_s, multipart_mb) go to S3Storage and are ignored for local roots.
    """
    if not uri or not str(uri).strip():
        raise CheckpointError("checkpoint root is empty; give a directory or s3://bucket/prefix")
    uri = str(uri).strip()
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        return S3Storage(bucket, prefix, **s3_options)
    if uri.startswith("file://"):
        return LocalStorage(uri[len("file://") :])
    if "://" in uri:
        scheme = uri.split("://", 1)[0]
        raise CheckpointError(f"checkpoint root {uri!r} uses unsupported scheme '{scheme}'; use a directory or s3://")
    return LocalStorage(uri)
