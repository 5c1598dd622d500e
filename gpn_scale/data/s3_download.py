"""Shard downloads from S3 through gpn_scale.io's client and retry loop, not streaming's own.

mosaicml-streaming downloads every shard (and the index) through its own boto3 client, in
botocore's "adaptive" retry mode with 3 attempts: `GPN_S3_RETRIES` did not reach it (at 50%
503 SlowDown a run died on its first batch even with GPN_S3_RETRIES=10), a corrupted transfer
(FlexibleChecksumError) was fatal, its client-side rate limiter made runs that survived slow
without a word, and a shard missing on S3 reached the user as "does not decompress" (the
not-found message names the `.zstd` file). `streaming_compat.install_s3_downloader()` maps
streaming's `s3://` scheme to a downloader whose transfers are `download_file` below, through
`gpn_scale.io.storage.call`: the endpoint, credentials, timeouts, retries and their backoff,
the "S3 retrying" line and the one-line errors of the checkpoints. A missing object is a
FileNotFoundError naming it (the loader says "shard ... is missing"). Nothing here imports
streaming.
"""

from __future__ import annotations

import errno
import os
import urllib.parse
import uuid
from collections.abc import Container

from gpn_scale.data.errors import DataError
from gpn_scale.io import storage as io_storage


def download_file(remote: str, local: str, requester_pays_buckets: Container[str] = ()) -> None:
    """Copy the object `remote` (s3://bucket/key) to the file `local`, through gpn_scale.io's
    client and retries (streaming's S3 downloader calls this: data/streaming_compat.py)."""
    from boto3.s3.transfer import TransferConfig

    url = urllib.parse.urlparse(remote)
    bucket, key = url.netloc, url.path.lstrip("/")
    client = io_storage.s3_client(DataError)
    policy = io_storage.RetryPolicy.from_env(error=DataError)
    extra = {"RequestPayer": "requester"} if bucket in requester_pays_buckets else {}
    # Into a name of its own, renamed when complete: a reader never sees half a shard.
    tmp = f"{local}.{uuid.uuid4().hex[:8]}.gpn.tmp"
    try:
        io_storage.call(
            f"download {os.path.basename(key)}",
            remote,
            lambda: client.download_file(
                bucket, key, tmp, ExtraArgs=extra, Config=TransferConfig(use_threads=False)
            ),
            policy=policy,
            error=DataError,
            subject="dataset root",
        )
        os.replace(tmp, local)
    except io_storage.NotFound as exc:
        raise FileNotFoundError(errno.ENOENT, f"{remote} is missing on S3 ({exc})", remote) from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
