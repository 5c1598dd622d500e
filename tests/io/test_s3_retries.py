"""One S3 retry policy (issue 36, item 4): a corrupted transfer is retried like a 503, a
multipart upload retries a part and not the whole file, and requests that succeed only after
retrying are said in a line (at most one a minute, with the count). Faults are injected
in-process (gpn_scale.testing.s3.S3Faults: a botocore hook that raises before anything is
sent), with deterministic counts and no backoff waits."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from gpn_scale.io.storage import RetryLog, RetryPolicy, S3Storage, StorageError, call, s3_retry
from gpn_scale.testing.s3 import S3Faults, checksum_mismatch, connection_reset, slow_down


def _storage(s3_endpoint, **options) -> S3Storage:
    bucket = s3_endpoint.create_bucket(f"retry-{uuid.uuid4().hex[:10]}").removeprefix("s3://")
    return S3Storage(bucket, "p", backoff_s=0.0, **options)


@pytest.fixture
def said(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The retry log's lines, with a clock that stands still (one line, however many)."""
    lines: list[str] = []
    monkeypatch.setattr(s3_retry, "RETRY_LOG", RetryLog(clock=lambda: 0.0, say=lines.append))
    return lines


def test_a_corrupted_transfer_is_retried(s3_endpoint, said) -> None:
    """Case 10: botocore's FlexibleChecksumError was fatal on the first attempt."""
    storage = _storage(s3_endpoint, retries=5)
    storage.put_bytes("k", b"payload")
    faults = S3Faults(storage.client).fail("GetObject", checksum_mismatch, lambda n, p: n <= 2)
    with faults:
        assert storage.get_bytes("k") == b"payload"
    assert faults.injected["GetObject"] == 2 and faults.calls["GetObject"] == 3
    assert len(said) == 1 and "2 retries of 1 request" in said[0]


def test_a_transfer_that_stays_corrupted_is_one_line(s3_endpoint, said) -> None:
    storage = _storage(s3_endpoint, retries=3)
    storage.put_bytes("k", b"payload")
    with S3Faults(storage.client).fail("GetObject", checksum_mismatch, lambda n, p: True):
        with pytest.raises(StorageError) as caught:
            storage.get_bytes("k")
    msg = str(caught.value)
    assert "arriving corrupted" in msg and "after 3 attempts" in msg and "\n" not in msg
    assert not said  # a request that failed for good is said by its error, not by the log


def test_connection_resets_are_retried(s3_endpoint, said) -> None:
    storage = _storage(s3_endpoint, retries=4)
    with S3Faults(storage.client).fail("PutObject", connection_reset, lambda n, p: n <= 3):
        storage.put_bytes("k", b"x")
    assert storage.get_bytes("k") == b"x"


def test_a_multipart_upload_retries_parts_not_the_file(s3_endpoint, tmp_path: Path, said) -> None:
    """Case 11: every other UploadPart answers 503 SlowDown. Retrying the whole file never
    gets four good parts in a row (all 5 attempts failed); retrying each part does, with
    exactly one retry per part."""
    storage = _storage(s3_endpoint, retries=5, multipart_mb=5)
    storage.transfer_config.max_concurrency = 1  # one part at a time: a deterministic order
    src = tmp_path / "big.bin"
    data = os.urandom(3 * 5 * 1024 * 1024 + 1000)  # four parts, the last one short
    src.write_bytes(data)
    faults = S3Faults(storage.client).fail("UploadPart", slow_down, lambda n, p: n % 2 == 1)
    with faults:
        info = storage.put_file(src, "ckpt/big.bin")
    assert info.size == len(data)
    assert faults.calls["UploadPart"] == 8 and faults.injected["UploadPart"] == 4
    assert faults.calls["CreateMultipartUpload"] == 1
    assert faults.calls["CompleteMultipartUpload"] == 1
    out = tmp_path / "back.bin"
    storage.get_file("ckpt/big.bin", out)
    assert out.read_bytes() == data
    # said once (the clock stands still): at the first part that went through on a retry
    assert len(said) == 1 and "1 retry of 1 request" in said[0] and "SlowDown" in said[0]
    assert "upload part 1 of 4 of ckpt/big.bin" in said[0]


def test_a_failed_multipart_upload_is_aborted(s3_endpoint, tmp_path: Path, said) -> None:
    storage = _storage(s3_endpoint, retries=2, multipart_mb=5)
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(5 * 1024 * 1024 + 10))
    faults = S3Faults(storage.client).fail("UploadPart", slow_down, lambda n, p: n >= 2)
    with faults, pytest.raises(StorageError) as caught:
        storage.put_file(src, "big.bin")
    assert "SlowDown" in str(caught.value) and "after 2 attempts" in str(caught.value)
    assert faults.calls["AbortMultipartUpload"] == 1
    listing = storage.client.list_multipart_uploads(Bucket=storage.bucket)
    assert not listing.get("Uploads")
    assert not storage.exists("big.bin")


def test_the_retry_line_masks_credentials_in_the_error_it_repeats(monkeypatch) -> None:
    """botocore's error text repeats the endpoint, which may carry a password."""
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://alice:s3cr3t@127.0.0.1:9")
    lines: list[str] = []
    RetryLog(clock=lambda: 0.0, say=lines.append).recovered(
        "read",
        "s3://b/k",
        2,
        "Could not connect to the endpoint URL: http://alice:s3cr3t@127.0.0.1:9/b/k",
    )
    assert len(lines) == 1 and "alice:***@127.0.0.1:9" in lines[0]
    assert "s3cr3t" not in lines[0], lines[0]


def test_the_retry_line_is_said_at_most_once_a_minute_with_the_count() -> None:
    now = [0.0]
    lines: list[str] = []
    log = RetryLog(clock=lambda: now[0], say=lines.append)
    policy = RetryPolicy(attempts=5, backoff_s=0.0)

    def flaky(failures: int):
        left = [failures]

        def fn() -> str:
            if left[0]:
                left[0] -= 1
                raise slow_down("GetObject")
            return "ok"

        return fn

    import gpn_scale.io.storage.s3_retry as mod

    old, mod.RETRY_LOG = mod.RETRY_LOG, log
    try:
        assert call("read a", "s3://b/a", flaky(2), policy=policy) == "ok"  # said at once
        now[0] = 30.0
        assert call("read b", "s3://b/b", flaky(1), policy=policy) == "ok"  # counted only
        assert call("read c", "s3://b/c", flaky(0), policy=policy) == "ok"  # no retry at all
        now[0] = 61.0
        assert call("read d", "s3://b/d", flaky(3), policy=policy) == "ok"  # a minute later
    finally:
        mod.RETRY_LOG = old
    assert len(lines) == 2, lines
    assert lines[0].startswith("S3 retrying: 2 retries of 1 request at ")
    assert "read a s3://b/a" in lines[0] and "SlowDown" in lines[0]
    assert lines[1].startswith("S3 retrying: 4 retries of 2 requests in the last 1 min")
    assert all("\n" not in line for line in lines)
