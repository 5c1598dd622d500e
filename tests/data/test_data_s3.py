"""Every S3 path over real HTTP against the local moto endpoint, and the failure modes:
corrupted shard, missing index, wrong credentials, unreachable endpoint, no overwrite."""

from __future__ import annotations

import json

import pytest
from data_helpers import build_counter_dataset, one_line, row_keys

from data_tools.cli import main as gpn_data
from gpn_scale.data import DataConfig, DataError, build_loader, read_metadata
from gpn_scale.data.storage import split_s3
from gpn_scale.testing.s3 import LocalS3, free_port


@pytest.fixture
def text_dir(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    with open(src / "docs.jsonl", "w") as fh:
        for i in range(60):
            fh.write(json.dumps({"id": i, "text": f"document {i}: " + "lorem ipsum " * 20}) + "\n")
    return src


def _shards(s3_endpoint, root: str, split: str) -> list[str]:
    bucket, prefix = split_s3(root)
    listing = s3_endpoint.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{split}/")
    return sorted(o["Key"] for o in listing["Contents"] if o["Key"].endswith(".zstd"))


def test_cli_build_to_s3_inspect_verify_and_corrupted_shard(
    s3_endpoint, s3_bucket, text_dir, tmp_path, capsys
):
    root = f"{s3_bucket}/ds"
    argv = [
        "build",
        str(text_dir),
        "--out",
        root,
        "--seq-len",
        "64",
        "--val-windows",
        "4",
        "--shard-size",
        "4kb",
        "-q",
    ]
    assert gpn_data(argv) == 0
    capsys.readouterr()
    meta = read_metadata(root)
    assert meta.source["documents"] == 60 and meta.splits["val"].samples == 4

    assert gpn_data(["inspect", root]) == 0
    shown = capsys.readouterr().out
    assert "vocab_size   257" in shown and "split train" in shown
    assert gpn_data(["inspect", root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["seq_len"] == 64
    assert gpn_data(["verify", root, "-q"]) == 0
    assert "ok:" in capsys.readouterr().out

    # nothing is written over existing shards unless asked
    shards = _shards(s3_endpoint, root, "train")
    assert len(shards) >= 2
    bucket, _ = split_s3(root)
    client = s3_endpoint.client()
    before = client.get_object(Bucket=bucket, Key=shards[1])["ETag"]
    assert gpn_data(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpn-data: error:") and "--overwrite" in err and "\n" not in err
    assert client.get_object(Bucket=bucket, Key=shards[1])["ETag"] == before

    # corrupt one shard: verify names it, and the loader names it too
    data = bytearray(client.get_object(Bucket=bucket, Key=shards[1])["Body"].read())
    data[len(data) // 2] ^= 0xFF
    client.put_object(Bucket=bucket, Key=shards[1], Body=bytes(data))
    bad_name = "train/" + shards[1].rsplit("/", 1)[1]
    assert gpn_data(["verify", root, "-q"]) == 2
    out = capsys.readouterr()
    assert f"BAD  {bad_name}: " in out.out
    assert bad_name in out.err and "\n" not in out.err.strip()

    loader = build_loader(
        DataConfig(remote=root, local_cache=str(tmp_path / "cache")), "train", 4, 0, 1
    )
    with pytest.raises(DataError) as caught:
        row_keys(loader)
    assert "corrupted shard" in one_line(caught.value) and bad_name in str(caught.value)

    # --overwrite replaces the dataset
    assert gpn_data(argv + ["--overwrite", "--seed", "3"]) == 0
    assert read_metadata(root).seed == 3
    assert gpn_data(["verify", root, "-q"]) == 0


def test_missing_index_and_missing_metadata(s3_endpoint, s3_bucket, tmp_path):
    root = f"{s3_bucket}/ds"
    build_counter_dataset(root, n_windows=40, val_windows=4)
    bucket, prefix = split_s3(root)
    s3_endpoint.client().delete_object(Bucket=bucket, Key=f"{prefix}/train/index.json")
    cfg = DataConfig(remote=root, local_cache=str(tmp_path / "c"))
    with pytest.raises(DataError) as caught:
        build_loader(cfg, "train", 4, 0, 1)
    assert "missing index" in one_line(caught.value) and "train/index.json" in str(caught.value)
    assert gpn_data(["verify", root, "-q"]) == 2

    with pytest.raises(DataError) as caught:
        read_metadata(f"{s3_bucket}/not-a-dataset")
    assert "no dataset metadata" in one_line(caught.value)
    with pytest.raises(DataError) as caught:
        read_metadata("s3://no-such-bucket-here/ds")
    assert "does not exist at" in one_line(caught.value)


def test_unreachable_endpoint(s3_endpoint, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("S3_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("GPN_S3_BACKOFF_S", "0.01")  # the retries, without their waits
    with pytest.raises(DataError) as caught:
        read_metadata("s3://bucket/ds")
    assert "cannot reach the S3 endpoint" in one_line(caught.value)
    with pytest.raises(DataError, match="cannot reach"):
        build_loader(DataConfig(remote="s3://bucket/ds"), "train", 4, 0, 1)
    src = tmp_path / "a.txt"
    src.write_text("hello world " * 100)
    assert gpn_data(["build", str(src), "--out", "s3://bucket/ds", "--seq-len", "16", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot reach the S3 endpoint" in err and "\n" not in err


def test_wrong_credentials(monkeypatch, tmp_path, capsys):
    with LocalS3(enforce_auth=True) as strict:
        for key, value in strict.env().items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG")
        with pytest.raises(DataError) as caught:
            read_metadata("s3://bucket/ds")
        assert "rejected the credentials" in one_line(caught.value)
        src = tmp_path / "a.txt"
        src.write_text("hello world " * 100)
        assert (
            gpn_data(["build", str(src), "--out", "s3://bucket/ds", "--seq-len", "16", "-q"]) == 2
        )
        err = capsys.readouterr().err.strip()
        assert "rejected the credentials" in err and "\n" not in err
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(DataError) as caught:
        read_metadata("s3://bucket/ds")
    assert "no S3 credentials" in one_line(caught.value)
