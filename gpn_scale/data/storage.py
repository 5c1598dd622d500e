"""Small, uniform file access for a dataset root that is either a local directory or
`s3://bucket/prefix`.

Streaming downloads shards by itself; this module serves what it does not: reading and
writing the metadata file, checking that an index exists before streaming starts (so that
the user gets one clear line instead of a retry storm), listing and deleting a split for
`--overwrite`, and fetching shards for `verify`. botocore failures are translated into
`DataError`s that say what went wrong (credentials, endpoint, bucket, key).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from gpn_scale.data.errors import DataError


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


def split_s3(url: str) -> tuple[str, str]:
    """'s3://bucket/a/b' -> ('bucket', 'a/b')."""
    rest = url[len("s3://"):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise DataError(f"{url}: no bucket in the S3 URL; write it as s3://bucket/prefix")
    return bucket, key.strip("/")


def endpoint_url() -> str | None:
    """The S3 endpoint that streaming also uses (its convention: `S3_ENDPOINT_URL`)."""
    return os.environ.get("S3_ENDPOINT_URL") or None


_CLIENTS: dict[tuple[Any, ...], Any] = {}


def s3_client() -> Any:
    """A boto3 S3 client on `S3_ENDPOINT_URL` with few retries, so that a dead endpoint
    fails in seconds instead of minutes. Cached per process and per environment (making
    a client costs ~0.1 s; they are thread-safe)."""
    import boto3
    from botocore.config import Config

    key = (os.getpid(), endpoint_url(), *(os.environ.get(k) for k in (
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
        "AWS_DEFAULT_REGION", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")))
    if key not in _CLIENTS:
        config = Config(retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=5,
                        read_timeout=60, max_pool_connections=32)
        _CLIENTS[key] = boto3.session.Session().client("s3", endpoint_url=endpoint_url(),
                                                       config=config)
    return _CLIENTS[key]


def translate_s3_error(err: BaseException, url: str) -> DataError:
    """Turn a botocore exception into a one-line DataError naming the problem and the fix."""
    from botocore import exceptions as bexc

    where = f" (S3_ENDPOINT_URL={endpoint_url()})" if endpoint_url() else ""
    if isinstance(err, bexc.NoCredentialsError):
        return DataError(f"{url}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
    if isinstance(err, (bexc.EndpointConnectionError, bexc.ConnectTimeoutError,
                        bexc.ConnectionClosedError)):
        return DataError(f"{url}: cannot reach the S3 endpoint{where or ' (AWS default)'}; "
                         "check S3_ENDPOINT_URL and the network")
    if isinstance(err, bexc.ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                    "InvalidToken", "ExpiredToken", "AuthFailure"} or status == 403:
            return DataError(f"{url}: S3 rejected the credentials ({code or status}){where}; "
                             "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket "
                             "policy")
        if code == "NoSuchBucket":
            return DataError(f"{url}: the bucket does not exist{where}; create it or fix the "
                             "URL")
        if code in {"NoSuchKey", "404", "NotFound"} or status == 404:
            return DataError(f"{url}: no such object{where}; check the path")
        return DataError(f"{url}: S3 error {code or status}{where}: {err}")
    if isinstance(err, bexc.BotoCoreError):
        return DataError(f"{url}: S3 client error{where}: {err}")
    return DataError(f"{url}: {type(err).__name__}: {err}")


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

    def _key(self, rel: str) -> tuple[str, str]:
        bucket, prefix = split_s3(self.root)
        key = f"{prefix}/{rel.strip('/')}" if prefix else rel.strip("/")
        return bucket, key

    def read_bytes(self, rel: str) -> bytes:
        if not self.remote:
            try:
                return Path(self.url(rel)).read_bytes()
            except FileNotFoundError:
                raise DataError(f"{self.url(rel)}: file not found; check the path") from None
        bucket, key = self._key(rel)
        try:
            return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except Exception as err:  # noqa: BLE001 - translated to one line
            raise translate_s3_error(err, self.url(rel)) from err

    def exists(self, rel: str) -> bool:
        if not self.remote:
            return Path(self.url(rel)).exists()
        from botocore.exceptions import ClientError

        bucket, key = self._key(rel)
        try:
            s3_client().head_object(Bucket=bucket, Key=key)
            return True
        except ClientError as err:
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(err.response.get("Error", {}).get("Code", ""))
            if status == 404 and code != "NoSuchBucket":
                # HEAD responses carry no error code: tell a missing bucket apart
                self._check_bucket(bucket)
                return False
            raise translate_s3_error(err, self.url(rel)) from err
        except Exception as err:  # noqa: BLE001
            raise translate_s3_error(err, self.url(rel)) from err

    def _check_bucket(self, bucket: str) -> None:
        try:
            s3_client().head_bucket(Bucket=bucket)
        except Exception as err:  # noqa: BLE001
            from botocore.exceptions import ClientError
            if isinstance(err, ClientError) and err.response.get(
                    "ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                err.response.setdefault("Error", {})["Code"] = "NoSuchBucket"
            raise translate_s3_error(err, f"s3://{bucket}") from err

    def write_bytes(self, rel: str, data: bytes) -> None:
        if not self.remote:
            path = Path(self.url(rel))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)  # readers never see half a file
            return
        bucket, key = self._key(rel)
        try:
            s3_client().put_object(Bucket=bucket, Key=key, Body=data)
        except Exception as err:  # noqa: BLE001
            raise translate_s3_error(err, self.url(rel)) from err

    def list(self, rel: str = "") -> Iterator[str]:
        """Relative names of all files under `rel` (recursive), sorted."""
        if not self.remote:
            base = Path(self.url(rel)) if rel else Path(self.root)
            if not base.exists():
                return iter(())
            names = sorted(str(p.relative_to(self.root)).replace(os.sep, "/")
                           for p in base.rglob("*") if p.is_file())
            return iter(names)
        bucket, key = self._key(rel) if rel else self._key("")
        _, root_prefix = split_s3(self.root)
        prefix = key.rstrip("/") + "/" if key else ""
        try:
            names = []
            for page in s3_client().get_paginator("list_objects_v2").paginate(
                    Bucket=bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    names.append(obj["Key"][len(root_prefix) + 1 if root_prefix else 0:])
            return iter(sorted(names))
        except Exception as err:  # noqa: BLE001
            raise translate_s3_error(err, self.url(rel)) from err

    def delete_tree(self, rel: str) -> int:
        """Delete every file under `rel`; returns how many were deleted."""
        names = list(self.list(rel))
        if not self.remote:
            target = Path(self.url(rel))
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
            return len(names)
        bucket, _ = split_s3(self.root)
        client = s3_client()
        try:
            for start in range(0, len(names), 1000):
                chunk = names[start:start + 1000]
                client.delete_objects(Bucket=bucket, Delete={
                    "Objects": [{"Key": self._key(n)[1]} for n in chunk], "Quiet": True})
        except Exception as err:  # noqa: BLE001
            raise translate_s3_error(err, self.url(rel)) from err
        return len(names)

    def delete(self, rel: str) -> None:
        if not self.remote:
            Path(self.url(rel)).unlink(missing_ok=True)
            return
        bucket, key = self._key(rel)
        try:
            s3_client().delete_object(Bucket=bucket, Key=key)
        except Exception as err:  # noqa: BLE001
            raise translate_s3_error(err, self.url(rel)) from err
