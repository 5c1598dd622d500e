"""s3://bucket/prefix (or any S3-compatible endpoint) as storage, through boto3: every
request under the one retry loop (s3_retry.py), multipart transfers retried part by part."""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from gpn_scale.io.storage.base import ErrorType, ObjectInfo, Storage, StorageError, noun
from gpn_scale.io.storage.s3_env import (
    endpoint_in_words,
    endpoint_url,
    endpoint_variable,
    env_number,
    s3_client,
)
from gpn_scale.io.storage.s3_errors import Conflict, NotFound, describe
from gpn_scale.io.storage.s3_retry import RetryPolicy, call

T = TypeVar("T")


class S3Storage(Storage):
    """s3://bucket/prefix through boto3 (endpoint, credentials, retries: see the module)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        retries: int | None = None,
        backoff_s: float | None = None,
        multipart_mb: float | None = None,
        error: ErrorType = StorageError,
        subject: str = "storage root",
    ) -> None:
        from boto3.s3.transfer import TransferConfig

        self.error = error
        self.subject = subject
        if not bucket:
            raise error("S3 URI has no bucket; write it as s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.policy = RetryPolicy.from_env(retries, backoff_s, error=error)
        self.retries = self.policy.attempts
        self.endpoint = endpoint_url()
        mb = (
            multipart_mb
            if multipart_mb is not None
            else env_number("GPN_S3_MULTIPART_MB", 64, error)
        )
        chunk = max(5 * 1024 * 1024, int(mb * 1024 * 1024))  # S3's minimum part size is 5 MiB
        self.transfer_config = TransferConfig(
            multipart_threshold=chunk,
            multipart_chunksize=chunk,
            max_concurrency=4,
            num_download_attempts=1,
        )
        self.client = s3_client(error)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return call(what, self.uri, fn, policy=self.policy, error=self.error, subject=self.subject)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_file(self, local_path: Path, key: str) -> ObjectInfo:
        full = self._key(key)
        size = local_path.stat().st_size
        if size > self.transfer_config.multipart_threshold:
            self._put_multipart(local_path, key, size)
            return ObjectInfo(size=size)
        self._call(
            f"upload {key}",
            lambda: self.client.upload_file(
                str(local_path), self.bucket, full, Config=self.transfer_config
            ),
        )
        return ObjectInfo(size=size)

    def _put_multipart(self, local_path: Path, key: str, size: int) -> None:
        """A multipart upload whose parts are each retried on their own (s3transfer's retries
        the whole file: a 4-part upload under 40% part faults failed all of its attempts); an
        upload that fails is aborted, so no parts are left to pay for."""
        from concurrent.futures import ThreadPoolExecutor

        full, chunk = self._key(key), self.transfer_config.multipart_chunksize
        count = -(-size // chunk)
        upload = self._call(
            f"start the upload of {key}",
            lambda: self.client.create_multipart_upload(
                Bucket=self.bucket, Key=full, ChecksumAlgorithm="CRC32"
            ),
        )["UploadId"]

        def send(number: int) -> dict[str, Any]:
            with open(local_path, "rb") as f:
                f.seek((number - 1) * chunk)
                body = f.read(chunk)
            out = self.client.upload_part(
                Bucket=self.bucket, Key=full, UploadId=upload, PartNumber=number, Body=body,
                ChecksumAlgorithm="CRC32",
            )  # fmt: skip
            part = {"PartNumber": number, "ETag": out["ETag"]}
            if out.get("ChecksumCRC32"):
                part["ChecksumCRC32"] = out["ChecksumCRC32"]
            return part

        def part(number: int) -> dict[str, Any]:
            return self._call(f"upload part {number} of {count} of {key}", lambda: send(number))

        pool = ThreadPoolExecutor(max(1, self.transfer_config.max_concurrency))
        try:
            parts = list(pool.map(part, range(1, count + 1)))
            self._call(
                f"finish the upload of {key}",
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload,
                    MultipartUpload={"Parts": parts},
                ),
            )  # fmt: skip
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload)
            raise
        finally:
            pool.shutdown(wait=True)

    def get_file(self, key: str, local_path: Path) -> None:
        local_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = local_path.with_name(f".{local_path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self._call(
                f"download {key}",
                lambda: self.client.download_file(
                    self.bucket, self._key(key), str(tmp), Config=self.transfer_config
                ),
            )
            os.replace(tmp, local_path)
        except NotFound as exc:
            raise self.error(
                f"{noun(self.subject)} file {self.child_uri(key)} is missing; it was "
                "deleted or never completely written"
            ) from exc
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        # A single PUT replaces an S3 object atomically.
        self._call(
            f"write {key}",
            lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data),
        )

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self._call(
                f"read {key}",
                lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(key))[
                    "Body"
                ].read(),
            )
        except NotFound:
            return None

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        def read() -> tuple[bytes, str]:
            out = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return out["Body"].read(), str(out.get("ETag", "")).strip('"')

        try:
            return self._call(f"read {key}", read)
        except NotFound:
            return None

    def put_if(self, key: str, data: bytes, version: str | None) -> str | None:
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": f'"{version}"'}
        try:
            out = self._call(
                f"write {key}",
                lambda: self.client.put_object(
                    Bucket=self.bucket, Key=self._key(key), Body=data, **condition
                ),
            )
        except (Conflict, NotFound):  # changed, or deleted, since `version` was read
            return None
        return str(out.get("ETag", "")).strip('"')

    def exists(self, key: str) -> bool:
        try:
            self._call(
                f"look up {key}",
                lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key)),
            )
            return True
        except NotFound:
            pass
        # A HEAD response has no body, so a missing bucket looks like a missing key: ask.
        try:
            self._call("look up the bucket", lambda: self.client.head_bucket(Bucket=self.bucket))
        except NotFound as exc:
            raise self.error(
                describe(
                    "bucket", str(exc), url=self.uri, what=f"look up {key}", subject=self.subject
                )
            ) from exc
        return False

    def delete(self, key: str) -> None:
        self._call(
            f"delete {key}",
            lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key)),
        )

    def _list_raw(self, prefix: str, delimiter: str | None) -> list[dict[str, Any]]:
        def run() -> list[dict[str, Any]]:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = delimiter
            return list(self.client.get_paginator("list_objects_v2").paginate(**kwargs))

        try:
            return self._call(f"list {prefix or '/'}", run)
        except NotFound as exc:  # NoSuchKey never comes from a listing; keep the message sane
            raise self.error(f"cannot list {self.uri}: {exc}; check the {self.subject}") from exc

    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        base = self._key(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        out: dict[str, ObjectInfo] = {}
        for page in self._list_raw(base, None):
            for obj in page.get("Contents", []):
                out[obj["Key"][strip:]] = ObjectInfo(
                    size=int(obj["Size"]), etag=str(obj.get("ETag", "")).strip('"')
                )
        return out

    def list_dirs(self) -> builtins.list[str]:  # (`list` is a method in here)
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
            self._call(
                f"delete {prefix}",
                functools.partial(self.client.delete_objects, Bucket=self.bucket, Delete=batch),
            )

    def preflight(self) -> None:
        probe = self._key(f".preflight-{uuid.uuid4().hex[:12]}")
        try:
            self._call(
                "write a probe object",
                lambda: self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"ok"),
            )
            self._call(
                "delete a probe object",
                lambda: self.client.delete_object(Bucket=self.bucket, Key=probe),
            )
        except NotFound as exc:
            # S3 answers a write into a missing bucket with NoSuchBucket; a plain 404 to a
            # PUT means the endpoint is not S3 (a web server, a wrong path in the URL).
            raise self.error(
                f"{self.uri}: the endpoint {endpoint_in_words()} answered 404 Not Found to "
                f"writing a probe object ({exc}); it is not an S3 service, or its URL is "
                f"wrong: check {endpoint_variable()} and the {self.subject}"
            ) from exc
