"""One storage layer: the data pipeline and the checkpoints resolve the S3 endpoint the same
way (whichever of S3_ENDPOINT_URL, AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL names it), retry the
same way, and fail with the same one-line message against a dead endpoint."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from data_tools.build import BuildOptions, build_dataset
from data_tools.tokenizer import resolve_tokenizer
from gpn_scale.checkpoint import CheckpointError, CheckpointManager, open_storage
from gpn_scale.data import DataConfig, DataError, build_loader, read_metadata
from gpn_scale.data.storage import Location
from gpn_scale.io.storage import ENDPOINT_VARIABLES, endpoint_url
from gpn_scale.testing.s3 import LocalS3, free_port


def _point_at(monkeypatch: pytest.MonkeyPatch, **variables: str) -> None:
    for name in ENDPOINT_VARIABLES + ("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_endpoint_order_is_boto3s_after_streamings(monkeypatch: pytest.MonkeyPatch) -> None:
    _point_at(monkeypatch)
    assert endpoint_url() is None
    _point_at(monkeypatch, AWS_ENDPOINT_URL="http://a")
    assert endpoint_url() == "http://a"
    _point_at(monkeypatch, AWS_ENDPOINT_URL="http://a", AWS_ENDPOINT_URL_S3="http://s3")
    assert endpoint_url() == "http://s3"
    _point_at(monkeypatch, AWS_ENDPOINT_URL_S3="http://s3", S3_ENDPOINT_URL="http://streaming")
    assert endpoint_url() == "http://streaming"
    # boto3 skips its own variables under this flag; S3_ENDPOINT_URL is ours and streaming's
    _point_at(monkeypatch, AWS_ENDPOINT_URL="http://a", AWS_IGNORE_CONFIGURED_ENDPOINT_URLS="true")
    assert endpoint_url() is None


@pytest.mark.parametrize("setting", ["S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_data_and_checkpoints_use_the_endpoint_named_by(
    setting: str,
    s3_endpoint: LocalS3,
    private_tmpdir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    variables = {setting: s3_endpoint.url}
    if setting == "AWS_ENDPOINT_URL_S3":
        # boto3 (and so streaming's own client) prefers the service-specific variable
        variables["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"  # nothing listens
    _point_at(monkeypatch, **variables)
    bucket = s3_endpoint.create_bucket(f"io-{uuid.uuid4().hex[:12]}")

    # data: streaming uploads the shards, our layer writes and reads the metadata, the loader
    # (streaming again) downloads a batch
    docs = [f"document {i} " * 8 for i in range(40)]
    options = BuildOptions(seq_len=16, val_windows=2, shard_size="1kb", progress=False)
    build_dataset(docs, f"{bucket}/ds", resolve_tokenizer("byte"), options, {})
    assert read_metadata(f"{bucket}/ds").seq_len == 16
    loader = build_loader(
        DataConfig(remote=f"{bucket}/ds", local_cache=str(tmp_path / "c")), "train", 2, 0, 1
    )
    batch = next(iter(loader))
    assert isinstance(batch, torch.Tensor) and batch.shape == (2, 16)

    # checkpoints: the manager and its storage on the same endpoint
    mgr = CheckpointManager(f"{bucket}/ck", staging_dir=str(tmp_path / "stage"))
    mgr.preflight()
    open_storage(f"{bucket}/ck").put_bytes("latest", json.dumps({"step": 1}).encode())

    # all of it landed on the moto server
    bucket_name = bucket.removeprefix("s3://")
    keys = {o["Key"] for o in s3_endpoint.client().list_objects_v2(Bucket=bucket_name)["Contents"]}
    assert {"ds/gpn_dataset.json", "ds/train/index.json", "ck/latest"} <= keys
    assert Location(f"{bucket}/ds").exists("train/index.json")


@pytest.mark.parametrize("setting", ["S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"])
def test_a_dead_endpoint_is_retried_and_reported_alike(
    setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    _point_at(monkeypatch, **{setting: dead})
    for key, value in {
        "AWS_ACCESS_KEY_ID": "a",
        "AWS_SECRET_ACCESS_KEY": "b",
        "AWS_DEFAULT_REGION": "us-east-1",
        "GPN_S3_RETRIES": "3",
        "GPN_S3_BACKOFF_S": "0.25",
    }.items():
        monkeypatch.setenv(key, value)
    sleeps: list[float] = []
    # The backoff is checked on the delays asked for, not on wall time. `time.sleep` is the
    # one function of the process: only this thread's calls are the retries' (a background
    # thread left by an earlier test once added its own 0.05 s poll here); others sleep.
    real_sleep, me = time.sleep, threading.current_thread()

    def sleep(seconds: float) -> None:
        if threading.current_thread() is me:
            sleeps.append(seconds)
        else:
            real_sleep(seconds)

    monkeypatch.setattr("gpn_scale.io.storage.s3_retry.time.sleep", sleep)

    with pytest.raises(DataError) as data_err:
        read_metadata("s3://bkt/ds")
    data_sleeps, sleeps[:] = list(sleeps), []
    with pytest.raises(CheckpointError) as ckpt_err:
        CheckpointManager("s3://bkt/ck", staging_dir="/nonexistent-not-used").preflight()
    assert data_sleeps == sleeps == [0.25, 0.5]
    for err in (data_err.value, ckpt_err.value):
        msg = str(err)
        assert "\n" not in msg
        assert "S3 unreachable" in msg and f"endpoint {dead}" in msg
        assert "after 3 attempts" in msg and f"check {setting}" in msg


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_conditional_write_lands_only_on_the_version_it_read(request, tmp_path, where):
    """put_if (the lease's writes): only where the object is still absent, or still the
    version read; a writer that lost writes nothing and learns it (None)."""
    from gpn_scale.io.storage import open_storage as open_any

    if where == "local":
        root = str(tmp_path / "root")
    else:
        s3 = request.getfixturevalue("s3_endpoint")
        root = f"{s3.create_bucket(f'putif-{uuid.uuid4().hex[:8]}')}/p"
    a, b = open_any(root), open_any(root)
    assert a.get_versioned("k") is None
    v1 = a.put_if("k", b"one", None)
    assert v1 and b.put_if("k", b"two", None) is None  # it exists now: the second create loses
    data, version = b.get_versioned("k")
    assert (data, version) == (b"one", v1)
    v2 = b.put_if("k", b"two", v1)
    assert v2 and v2 != v1
    assert a.put_if("k", b"three", v1) is None  # read v1, but b wrote since
    assert a.get_bytes("k") == b"two"
    a.delete("k")
    assert a.put_if("k", b"four", v2) is None  # deleted since v2 was read
    assert a.get_versioned("k") is None
    if where == "local":  # the lock beside it is gone after each write
        assert sorted(p.name for p in Path(root).iterdir()) == []
