"""Where files live outside the process: a local (or shared) directory, or an S3 prefix.

Both backends speak in *keys* relative to their root (`step_000000100/__0_0.distcp`,
`train/index.json`), so callers never build paths or URLs themselves. The data pipeline
(`gpn_scale.data.storage.Location`) and the checkpoint manager use this one package, so the
two agree on everything below.

Its modules: base (the interface, keys, errors, S3 URLs), local and s3 (the backends), s3_env
(endpoint, environment, client), s3_errors (classify, describe) and s3_retry (the retry loop);
every public name is importable from here.

Endpoint: the first of `S3_ENDPOINT_URL` (streaming's convention), `AWS_ENDPOINT_URL_S3`,
`AWS_ENDPOINT_URL` (boto3's own, in boto3's order; both skipped when
`AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true`, as boto3 does) that is set, else AWS. A custom
endpoint gets path-style addressing (MinIO, moto, most S3-compatible stores need it).
Streaming's own downloads pass only `S3_ENDPOINT_URL` and leave the others to boto3, which
resolves them in the same order, so shards and metadata come from the same place.

Credentials: boto3's normal chain (environment, profile, instance role).

Retries: botocore's own are switched off and replaced by one bounded exponential-backoff loop
(`RetryPolicy`: `GPN_S3_RETRIES` attempts, default 5; delays `GPN_S3_BACKOFF_S` * 2**i,
default 0.5 s, capped at 8 s), so that the number of attempts and the delays are known (and
short in tests), and so that errors that retrying will not cure (credentials, a missing
bucket) fail on the first attempt with one line. Retried: no connection, a connection reset
or a body cut short, timeouts, 5xx and throttling (503 SlowDown), and a transfer that arrived
corrupted (botocore's FlexibleChecksumError; BadDigest). The same loop serves the shard
downloads of the data loader (gpn_scale.data.s3_download replaces streaming's own client),
and a multipart upload retries each part on its own, never the whole file. Requests that
succeed only after retrying are said on stderr (`RETRY_LOG`: one line a minute at most, with
the count), so a run slowed down by a throttling store says so. Timeouts:
`GPN_S3_CONNECT_TIMEOUT_S` (default 5), `GPN_S3_READ_TIMEOUT_S` (default 60). Multipart
uploads/downloads: `GPN_S3_MULTIPART_MB` (default 64) per part.

Errors: every failure is one line naming the problem and the fix, raised as the caller's own
error type (`error=`, default `StorageError`) so that this package imports nothing else of
gpn_scale; `subject` names what the root is to the user ("checkpoint root", "dataset root").

Conditional writes (`get_versioned` / `put_if`, for the run lease): a write that lands only if
the object is still the version the writer read (or still absent), so two writers can never
both win. S3: `If-Match` / `If-None-Match: *` on the PUT (AWS since 2024, MinIO, moto; a store
that ignores them needs the lease's read-back and heartbeat checks); local: the read, compare
and replace under a lock file created with O_CREAT | O_EXCL beside the object.
"""

from __future__ import annotations

from typing import Any

from gpn_scale.io.storage.base import (
    ErrorType,
    ObjectInfo,
    Storage,
    StorageError,
    is_s3,
    join,
    one_line,
    split_s3,
)
from gpn_scale.io.storage.local import (
    DISK_ERRNOS,
    LOCK_STALE_S,
    LocalStorage,
    fsync_dir,
    os_error_line,
    writable_dir,
)
from gpn_scale.io.storage.s3 import S3Storage
from gpn_scale.io.storage.s3_env import (
    ENDPOINT_VARIABLES,
    endpoint_setting,
    endpoint_url,
    env_number,
    redact_urls,
    s3_client,
)
from gpn_scale.io.storage.s3_errors import RETRIED, Conflict, NotFound, classify, describe
from gpn_scale.io.storage.s3_retry import RETRY_LOG, RetryLog, RetryPolicy, call

__all__ = [
    "DISK_ERRNOS",
    "ENDPOINT_VARIABLES",
    "LOCK_STALE_S",
    "RETRIED",
    "RETRY_LOG",
    "Conflict",
    "ErrorType",
    "LocalStorage",
    "NotFound",
    "ObjectInfo",
    "RetryLog",
    "RetryPolicy",
    "S3Storage",
    "Storage",
    "StorageError",
    "call",
    "classify",
    "describe",
    "endpoint_setting",
    "endpoint_url",
    "env_number",
    "fsync_dir",
    "is_s3",
    "join",
    "one_line",
    "open_storage",
    "os_error_line",
    "redact_urls",
    "s3_client",
    "split_s3",
    "writable_dir",
]


def open_storage(
    uri: str, *, error: ErrorType = StorageError, subject: str = "storage root", **s3_options: Any
) -> Storage:
    """LocalStorage for a path (or file://path), S3Storage for s3://bucket/prefix.

    `s3_options` (retries, backoff_s, multipart_mb) go to S3Storage and are ignored for local
    roots."""
    if not uri or not str(uri).strip():
        raise error(f"{subject} is empty; give a directory or s3://bucket/prefix")
    uri = str(uri).strip()
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        return S3Storage(bucket, prefix, error=error, subject=subject, **s3_options)
    if uri.startswith("file://"):
        return LocalStorage(uri[len("file://") :], error=error, subject=subject)
    if "://" in uri:
        scheme = uri.split("://", 1)[0]
        raise error(
            f"{subject} {uri!r} uses unsupported scheme '{scheme}'; use a directory or s3://"
        )
    return LocalStorage(uri, error=error, subject=subject)
