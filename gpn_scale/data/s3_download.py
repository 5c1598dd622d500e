"""Shard downloads from S3 through gpn_scale.io's client and retry loop, not streaming's own.

mosaicml-streaming downloads every shard (and the index) through its own boto3 client, in
botocore's "adaptive" retry mode with 3 attempts: `GPN_S3_RETRIES` did not reach it (at 50%
503 SlowDown a run died on its first batch even with GPN_S3_RETRIES=10), a corrupted transfer
(FlexibleChecksumError) was fatal, its client-side rate limiter made runs that survived slow
without a word, and a shard missing on S3 reached the user as "does not decompress" (the
not-found message names the `.zstd` file). `install()` maps streaming's `s3://` scheme to
`S3Downloader` below, whose downloads go through `gpn_scale.io.storage.call`: the endpoint,
credentials, timeouts, retries and their backoff, the "S3 retrying" line and the one-line
errors of the checkpoints. A missing object is a FileNotFoundError naming it (the loader says
"shard ... is missing").
"""

from __future__ import annotations

import errno
import os
import threading
import urllib.parse
import uuid
from typing import Any

from gpn_scale.data.errors import DataError
from gpn_scale.data.streaming_import import import_streaming
from gpn_scale.io import storage as io_storage

_INSTALL_LOCK = threading.Lock()


def _downloader_class() -> type:
    import_streaming()  # without transformers (data/streaming_import.py)
    from streaming.base.storage.download import S3Downloader as StreamingS3Downloader

    class S3Downloader(StreamingS3Downloader):
        """streaming's S3 downloader, its transfers made by gpn_scale.io (see the module)."""

        _gpn = True

        def _download_file_impl(self, remote: str, local: str, timeout: float) -> None:
            from boto3.s3.transfer import TransferConfig

            url = urllib.parse.urlparse(remote)
            bucket, key = url.netloc, url.path.lstrip("/")
            client = io_storage.s3_client(DataError)
            policy = io_storage.RetryPolicy.from_env(error=DataError)
            extra = {"RequestPayer": "requester"} if bucket in self._requester_pays_buckets else {}
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
                raise FileNotFoundError(
                    errno.ENOENT, f"{remote} is missing on S3 ({exc})", remote
                ) from exc
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)

    S3Downloader.__module__ = __name__
    S3Downloader.__qualname__ = "S3Downloader"
    return S3Downloader


_CLASS: type | None = None


def downloader_class() -> type:
    """The S3Downloader subclass (made once: it subclasses streaming's, imported lazily)."""
    global _CLASS
    with _INSTALL_LOCK:
        if _CLASS is None:
            _CLASS = _downloader_class()
        return _CLASS


def install() -> None:
    """Make streaming download `s3://` through `S3Downloader` (this process; DataLoader
    workers get the dataset's downloader objects pickled, of this class). Idempotent."""
    cls = downloader_class()
    from streaming.base.storage import download

    download.DOWNLOADER_MAPPINGS["s3"] = cls


def __getattr__(name: str) -> Any:
    # `S3Downloader` by name, for pickling into DataLoader workers (they unpickle by module
    # and qualname, and this class is made on first use).
    if name == "S3Downloader":
        return downloader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
