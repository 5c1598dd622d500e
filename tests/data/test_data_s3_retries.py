"""The loader's S3 and cache failures (issue 36, item 4): shard downloads follow
GPN_S3_RETRIES (they went through streaming's own client, 3 attempts), a shard missing on
S3 is "missing" (not "does not decompress"), a garbage index.json is one line naming it and
`gpn-data verify`, and a cache that is too small or a cache disk that is full is one line
naming data.cache_limit. S3 faults are injected in-process on gpn_scale.io's client."""

from __future__ import annotations

import errno
import json
from collections import Counter

import pytest
from data_helpers import build_counter_dataset, one_line, row_keys

from gpn_scale.data import DataConfig, DataError, build_loader
from gpn_scale.data.storage import split_s3
from gpn_scale.io import storage as io_storage
from gpn_scale.io.storage import RetryLog, s3_retry
from gpn_scale.testing.s3 import S3Faults, slow_down


def test_shard_downloads_follow_gpn_s3_retries(s3_endpoint, s3_bucket, tmp_path, monkeypatch):
    """Case 8: every shard's first 5 requests answer 503 SlowDown (streaming's own client
    gave up after 3); with GPN_S3_RETRIES=10 the epoch is complete, and it says so."""
    root = f"{s3_bucket}/ds"
    build_counter_dataset(root, n_windows=40, val_windows=4)
    monkeypatch.setenv("GPN_S3_RETRIES", "10")
    monkeypatch.setenv("GPN_S3_BACKOFF_S", "0")
    lines: list[str] = []
    monkeypatch.setattr(s3_retry, "RETRY_LOG", RetryLog(clock=lambda: 0.0, say=lines.append))
    per_key: Counter[str] = Counter()

    def first_five_of_each_shard(n: int, params: dict) -> bool:
        key = str(params.get("Key", ""))
        if not key.endswith(".zstd"):
            return False
        per_key[key] += 1
        return per_key[key] <= 5

    faults = S3Faults(io_storage.s3_client()).fail(
        "HeadObject", slow_down, first_five_of_each_shard
    )
    faults.fail("GetObject", slow_down, first_five_of_each_shard)
    loader = build_loader(
        DataConfig(remote=root, local_cache=str(tmp_path / "c")), "train", 4, 0, 1
    )
    try:
        with faults:
            keys = row_keys(loader)
    finally:
        loader.close()
    assert len(keys) == 36 // 4 * 4
    shards = len(per_key)
    assert shards >= 2 and sum(faults.injected.values()) == 5 * shards
    assert len(lines) == 1 and lines[0].startswith("S3 retrying: 5 retries of 1 request")


def test_a_shard_missing_on_s3_is_missing(s3_endpoint, s3_bucket, tmp_path, monkeypatch):
    """Case 17: it was "does not decompress" (the not-found text names the .zstd file)."""
    root = f"{s3_bucket}/ds"
    build_counter_dataset(root, n_windows=40, val_windows=4)
    monkeypatch.setenv("GPN_S3_BACKOFF_S", "0")
    bucket, prefix = split_s3(root)
    client = s3_endpoint.client()
    listing = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/train/")["Contents"]
    shard = sorted(o["Key"] for o in listing if o["Key"].endswith(".zstd"))[0]
    client.delete_object(Bucket=bucket, Key=shard)
    loader = build_loader(
        DataConfig(remote=root, local_cache=str(tmp_path / "c")), "train", 4, 0, 1
    )
    try:
        with pytest.raises(DataError) as caught:
            row_keys(loader)
    finally:
        loader.close()
    msg = one_line(caught.value)
    assert "is missing" in msg and shard.rsplit("/", 1)[1] in msg and "gpn-data verify" in msg
    assert "decompress" not in msg and "\n" not in str(caught.value)


def test_a_garbage_index_is_one_line(tmp_path):
    """Case 6 (the loader): a JSONDecodeError traceback from inside streaming."""
    root = tmp_path / "ds"
    build_counter_dataset(str(root), n_windows=40, val_windows=4)
    (root / "train" / "index.json").write_text('{"version": 2, "shards": [')
    with pytest.raises(DataError) as caught:
        build_loader(
            DataConfig(remote=str(root), local_cache=str(tmp_path / "c")), "train", 4, 0, 1
        )
    msg = str(caught.value)
    assert f"{root}/train/index.json is not a valid index" in msg
    assert f"gpn-data verify {root}" in msg and "\n" not in msg


def test_a_cache_limit_below_a_shard_names_data_cache_limit(tmp_path):
    root = tmp_path / "ds"
    build_counter_dataset(str(root), n_windows=40, val_windows=4)
    cfg = DataConfig(remote=str(root), local_cache=str(tmp_path / "c"), cache_limit="1kb")
    with pytest.raises(DataError) as caught:
        build_loader(cfg, "train", 4, 0, 1)
    msg = str(caught.value)
    assert msg.startswith("data.cache_limit is too small") and "raise data.cache_limit" in msg
    assert "\n" not in msg


def test_a_full_cache_disk_is_one_line(tmp_path, monkeypatch):
    """Case 5: a shard write that finds no room was a 60-line traceback from streaming."""
    from streaming.base.storage.download import LocalDownloader

    root = tmp_path / "ds"
    build_counter_dataset(str(root), n_windows=40, val_windows=4)
    real = LocalDownloader._download_file_impl

    def no_room(self, remote, local, timeout):
        if remote.endswith(".zstd"):
            raise OSError(errno.ENOSPC, "No space left on device", local)
        return real(self, remote, local, timeout)

    monkeypatch.setattr(LocalDownloader, "_download_file_impl", no_room)
    cache = tmp_path / "c"
    loader = build_loader(DataConfig(remote=str(root), local_cache=str(cache)), "train", 4, 0, 1)
    try:
        with pytest.raises(DataError) as caught:
            row_keys(loader)
    finally:
        loader.close()
    msg = str(caught.value)
    assert msg.startswith("the data cache is full: no space left on device in ")
    assert str(cache) in msg and "data.cache_limit" in msg and "data.local_cache" in msg
    assert "\n" not in msg


def test_data_cache_limit_is_a_config_key():
    from gpn_scale.core.config import ConfigError
    from gpn_scale.run.config import TrainConfig, validate

    cfg = TrainConfig()
    for good in (None, "20gb", "500MB", "1073741824", "2.5gb", "4096b"):
        cfg.data.cache_limit = good
        validate(cfg)
    for bad in ("lots", "0gb", "-1gb", "1.5b", "20 parsecs"):
        cfg.data.cache_limit = bad
        with pytest.raises(ConfigError, match="data.cache_limit: expected a size"):
            validate(cfg)
    assert json.dumps(TrainConfig().data.cache_limit) == "null"
