"""Checkpoints on S3 (moto over real HTTP): round trip, multipart, partials, retention, the
endpoint dying mid-save, and one-line errors for bad credentials / endpoint / bucket."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import boto3
import pytest
from ckpt_helpers import app_state, apply, assert_same, assert_same_training_state, fresh, trained

from gpn_scale.checkpoint import (
    CheckpointError,
    CheckpointManager,
    S3Storage,
    capture_rng_state,
    open_storage,
)
from gpn_scale.testing.s3 import LocalS3, free_port

FAST = {"s3_retries": 2, "s3_backoff_s": 0.01}


def _client() -> boto3.client:
    return boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])


def _bucket_prefix(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix


def _save(mgr: CheckpointManager, step: int, seed: int = 0) -> tuple[str, tuple]:
    model, opt = trained(seed=seed)
    uri = mgr.save(
        step,
        app_state(model, opt),
        meta={"step": step, "wandb_run_id": "r1"},
        rank_state={"rng": capture_rng_state()},
    )
    return uri, (model, opt)


def test_s3_round_trip_exact(s3_bucket: str, tmp_path: Path) -> None:
    root = f"{s3_bucket}/run/ckpt"
    mgr = CheckpointManager(root, staging_dir=str(tmp_path / "stage"), **FAST)
    mgr.preflight()
    assert mgr.latest() is None
    _save(mgr, 1, seed=3)
    model, opt = trained(seed=0)
    rank_state = {"rng": capture_rng_state(), "loader": {"sample": 17}}
    uri = mgr.save(2, app_state(model, opt), meta={"step": 2, "tokens": 99}, rank_state=rank_state)
    assert uri == f"{root}/step_000000002"
    assert mgr.latest() == uri and mgr.resolve_resume("auto") == uri

    # A second manager (a restarted job) finds and loads it.
    mgr2 = CheckpointManager(root, staging_dir=str(tmp_path / "stage2"), **FAST)
    assert mgr2.latest() == uri
    model2, opt2 = fresh()
    app = app_state(model2, opt2)
    loaded = mgr2.load(uri, app)
    apply(model2, opt2, app)
    assert_same_training_state(model, opt, model2, opt2)
    assert loaded.meta == {"step": 2, "tokens": 99} and loaded.step == 2
    assert_same(loaded.rank_state, rank_state)

    bucket, prefix = _bucket_prefix(root)
    manifest = json.loads(
        _client()
        .get_object(Bucket=bucket, Key=f"{prefix}/step_000000002/manifest.json")["Body"]
        .read()
    )
    assert all(e.get("etag") and len(e["sha256"]) == 64 for e in manifest["files"].values())
    pointer = json.loads(_client().get_object(Bucket=bucket, Key=f"{prefix}/latest")["Body"].read())
    assert pointer == {"step": 2, "name": "step_000000002"}
    # Staging (upload and download) is cleaned up.
    assert not [p for p in (tmp_path / "stage").rglob("*") if p.is_file()]
    assert not [p for p in (tmp_path / "stage2").rglob("*") if p.is_file()]


def test_two_readers_on_one_machine_never_share_a_download(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36 case 12: two readers of one S3 checkpoint on a machine share its staging root
    (for S3 one per machine by default). The first to finish deleted the download under the
    second, which then failed with a misleading message. Each load has a folder of its own:
    here the second reader loads and finishes while the first is between its download and
    its read, and both get the checkpoint's exact state."""
    import gpn_scale.checkpoint.loading as loading_module

    root = f"{s3_bucket}/two-readers"
    uri, (model, opt) = _save(CheckpointManager(root, staging_dir=str(tmp_path / "w"), **FAST), 1)
    stage = tmp_path / "one-machine"
    first = CheckpointManager(root, staging_dir=str(stage), **FAST)
    second = CheckpointManager(root, staging_dir=str(stage), **FAST)
    read_metadata = loading_module.safe_unpickle_metadata
    seconds: list[tuple] = []

    def second_reader_meanwhile(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not seconds:  # the first reader has its files: the second reads it all now
            seconds.append(fresh())
            app = app_state(*seconds[0])
            second.load(uri, app)
            apply(*seconds[0], app)
        return read_metadata(*args, **kwargs)

    monkeypatch.setattr(loading_module, "safe_unpickle_metadata", second_reader_meanwhile)
    model1, opt1 = fresh()
    app1 = app_state(model1, opt1)
    first.load(uri, app1)
    apply(model1, opt1, app1)
    assert seconds, "the second reader never ran"
    assert_same_training_state(model, opt, model1, opt1)
    assert_same_training_state(model, opt, *seconds[0])
    assert not [p for p in stage.rglob("*") if p.is_file()]  # both downloads removed


def test_s3_multipart_upload_and_download(s3_bucket: str, tmp_path: Path) -> None:
    storage = open_storage(f"{s3_bucket}/mp", multipart_mb=5)
    assert isinstance(storage, S3Storage)
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(11 * 1024 * 1024))  # 3 parts of 5 MiB
    want = hashlib.sha256(src.read_bytes()).hexdigest()
    info = storage.put_file(src, "x/big.bin")
    assert info.size == 11 * 1024 * 1024
    listing = storage.list("x/")
    assert listing["x/big.bin"].etag.endswith("-3")  # S3's multipart ETag form: really 3 parts
    storage.get_file("x/big.bin", tmp_path / "back.bin")
    assert hashlib.sha256((tmp_path / "back.bin").read_bytes()).hexdigest() == want


@pytest.mark.parametrize("damage", ["delete_shard", "delete_manifest", "rewrite_same_size"])
def test_s3_partial_never_picked(s3_bucket: str, tmp_path: Path, damage: str) -> None:
    root = f"{s3_bucket}/ck"
    mgr = CheckpointManager(root, staging_dir=str(tmp_path / "stage"), **FAST)
    good, _ = _save(mgr, 1)
    bad, _ = _save(mgr, 2, seed=1)
    bucket, prefix = _bucket_prefix(root)
    c = _client()
    if damage == "delete_shard":
        c.delete_object(Bucket=bucket, Key=f"{prefix}/step_000000002/__0_0.distcp")
    elif damage == "delete_manifest":
        c.delete_object(Bucket=bucket, Key=f"{prefix}/step_000000002/manifest.json")
    else:
        key = f"{prefix}/step_000000002/rank_00000.pt"
        data = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
        data[-1] ^= 0xFF
        c.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    assert mgr.latest() == good
    with pytest.raises(CheckpointError, match="pick a complete checkpoint"):
        mgr.resolve_resume(bad)


def test_s3_retention_keeps_last_k(s3_bucket: str, tmp_path: Path) -> None:
    root = f"{s3_bucket}/ret"
    mgr = CheckpointManager(root, keep_last=2, staging_dir=str(tmp_path / "stage"), **FAST)
    uris = [_save(mgr, s)[0] for s in (1, 2, 3)]
    assert mgr.latest() == uris[-1]
    assert [c[0] for c in mgr.list_checkpoints()] == [3, 2]
    bucket, prefix = _bucket_prefix(root)
    keys = [
        o["Key"]
        for o in _client()
        .list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/step_000000001/")
        .get("Contents", [])
    ]
    assert keys == []


def test_endpoint_dies_mid_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The S3 server stops after the first file of a save is uploaded: one-line error, and the
    previous checkpoint is still what latest() returns once the endpoint is back."""
    port = free_port()
    server = LocalS3(port=port).start()
    try:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        server.create_bucket("midsave")
        mgr = CheckpointManager("s3://midsave/run", staging_dir=str(tmp_path / "stage"), **FAST)
        uri1, (model1, opt1) = _save(mgr, 100, seed=0)

        original = S3Storage.put_file
        calls = {"n": 0}

        def dying_put_file(self: S3Storage, local_path: Path, key: str):  # type: ignore[no-untyped-def]
            result = original(self, local_path, key)
            calls["n"] += 1
            if calls["n"] == 1:
                server.stop()  # the endpoint dies between two uploads of the same save
            return result

        monkeypatch.setattr(S3Storage, "put_file", dying_put_file)
        t0 = time.monotonic()
        with pytest.raises(CheckpointError) as ei:
            _save(mgr, 200, seed=1)
        msg = str(ei.value)
        assert "\n" not in msg
        assert "step_000000200 not saved" in msg and "previous latest is unchanged" in msg
        assert "S3 unreachable" in msg and "after 2 attempts" in msg and "S3_ENDPOINT_URL" in msg
        assert time.monotonic() - t0 < 60  # retries are bounded (a generous bound: load varies)
        monkeypatch.setattr(S3Storage, "put_file", original)
    finally:
        server.stop()

    server = LocalS3(port=port).start()  # same port, same in-process moto state
    try:
        assert mgr.latest() == uri1
        c = _client()
        assert (
            json.loads(c.get_object(Bucket="midsave", Key="run/latest")["Body"].read())["step"]
            == 100
        )
        assert "Contents" not in c.list_objects_v2(
            Bucket="midsave", Prefix="run/step_000000200/manifest.json"
        )
        model2, opt2 = fresh()
        app = app_state(model2, opt2)
        assert mgr.load(mgr.latest(), app).step == 100
        apply(model2, opt2, app)
        assert_same_training_state(model1, opt1, model2, opt2)
    finally:
        server.stop()


# -- bad input: one line naming the problem and the fix, from preflight() -----------------------


def _one_line_error(mgr: CheckpointManager) -> str:
    with pytest.raises(CheckpointError) as ei:
        mgr.preflight()
    assert "\n" not in str(ei.value)
    return str(ei.value)


def test_missing_credentials(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    msg = _one_line_error(
        CheckpointManager(f"{s3_bucket}/x", staging_dir=str(tmp_path / "s"), **FAST)
    )
    assert "no S3 credentials" in msg and "AWS_ACCESS_KEY_ID" in msg


def test_wrong_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = LocalS3(enforce_auth=True).start()  # a moto process that checks access keys
    try:
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        sleeps: list[float] = []
        monkeypatch.setattr("gpn_scale.io.storage.s3_retry.time.sleep", sleeps.append)
        msg = _one_line_error(
            CheckpointManager(
                "s3://somebucket/x", staging_dir=str(tmp_path / "s"), s3_retries=5, s3_backoff_s=1.0
            )
        )
        assert sleeps == []  # auth errors are not retried (no backoff sleep at all)
        assert (
            "rejected the credentials" in msg
            and "InvalidAccessKeyId" in msg
            and "AWS_SECRET_ACCESS_KEY" in msg
        )
    finally:
        server.stop()


def test_unreachable_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("S3_ENDPOINT_URL", url)
    for k, v in {
        "AWS_ACCESS_KEY_ID": "a",
        "AWS_SECRET_ACCESS_KEY": "b",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    msg = _one_line_error(
        CheckpointManager(
            "s3://bkt/x", staging_dir=str(tmp_path / "s"), s3_retries=3, s3_backoff_s=0.01
        )
    )
    assert (
        "S3 unreachable" in msg
        and url in msg
        and "after 3 attempts" in msg
        and "check S3_ENDPOINT_URL" in msg
    )


def test_nonexistent_bucket(s3_endpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    msg = _one_line_error(
        CheckpointManager("s3://no-such-bucket-4242/x", staging_dir=str(tmp_path / "s"), **FAST)
    )
    assert "bucket 'no-such-bucket-4242' does not exist" in msg and "create it" in msg


def test_transient_errors_are_retried_with_backoff(
    s3_endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    from botocore.exceptions import ClientError, EndpointConnectionError

    storage = S3Storage("b", "p", retries=4, backoff_s=0.01)
    attempts: list[int] = []
    sleeps: list[float] = []
    # The backoff is checked on the delays asked for, not on wall time (load makes that noisy).
    monkeypatch.setattr("gpn_scale.io.storage.s3_retry.time.sleep", sleeps.append)

    def flaky() -> str:
        attempts.append(len(attempts))
        if len(attempts) == 1:
            raise EndpointConnectionError(endpoint_url="http://x")
        if len(attempts) == 2:
            raise ClientError(
                {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}},
                "PutObject",
            )
        return "ok"

    assert storage._call("write", flaky) == "ok"
    assert len(attempts) == 3
    assert (
        len(sleeps) == 2 and sleeps[1] >= 2 * sleeps[0] * 0.99 and sleeps[0] >= 0.01
    )  # exponential


def test_an_endpoint_that_answers_404_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A web server (not S3) at S3_ENDPOINT_URL: the checkpoint write probe says so in one
    line, and `train` stops with exit 2 before it creates anything."""
    import http.server
    import threading

    from gpn_scale.cli import main

    class NotS3(http.server.BaseHTTPRequestHandler):
        def _404(self) -> None:
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(b"<html><body>404 Not Found</body></html>")

        do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _404

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("S3_ENDPOINT_URL", url)
        for k, v in {
            "AWS_ACCESS_KEY_ID": "a",
            "AWS_SECRET_ACCESS_KEY": "b",
            "AWS_DEFAULT_REGION": "us-east-1",
            "GPN_S3_RETRIES": "1",
        }.items():
            monkeypatch.setenv(k, v)
        msg = _one_line_error(CheckpointManager("s3://bkt/x", staging_dir=str(tmp_path / "s")))
        assert "404 Not Found" in msg and "not an S3 service" in msg and url in msg
        run_dir = tmp_path / "run"
        code = main(["train", "ci_tiny", f"run_dir={run_dir}", "checkpoint.root=s3://bkt/x"])
        assert code == 2 and not run_dir.exists()
    finally:
        server.shutdown()
