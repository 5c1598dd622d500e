"""Trainer level: the S3 endpoint dies in the middle of a checkpoint save. The run stops with
one clear line, the previous `latest` checkpoint is intact, and the next `--resume auto`
(endpoint back) continues from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import train_args, train_losses

from gpn_scale.cli import main

pytestmark = pytest.mark.slow


def test_s3_dies_mid_save_then_resume_uses_previous_latest(corpus, tmp_path, monkeypatch, capsys):
    from gpn_scale.io.storage import S3Storage
    from gpn_scale.testing.s3 import LocalS3, free_port

    port = free_port()
    server = LocalS3(port=port).start()
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("GPN_S3_RETRIES", "1")  # fail fast: bounded retries
    monkeypatch.setenv("GPN_S3_BACKOFF_S", "0.05")
    monkeypatch.setenv("GPN_CKPT_STAGING", str(tmp_path / "stage"))
    server.create_bucket("midsave")
    root = "s3://midsave/run/ckpt"
    run_dir = tmp_path / "run"
    args = train_args(
        corpus,
        run_dir,
        f"checkpoint.root={root}",
        "checkpoint.every_steps=2",
        "schedule.total_steps=6",
    )

    original = S3Storage.put_file

    def dying_put_file(self, local_path: Path, key: str):
        result = original(self, local_path, key)
        if "step_000000004" in key:
            server.stop()  # the endpoint dies between two uploads of the step-4 save
        return result

    try:
        monkeypatch.setattr(S3Storage, "put_file", dying_put_file)
        assert main(args) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1, err
        assert "step_000000004 not saved" in err[0] and "previous latest is unchanged" in err[0]
        assert max(train_losses(run_dir)) == 4
    finally:
        monkeypatch.setattr(S3Storage, "put_file", original)
        server.stop()

    server = LocalS3(port=port).start()  # same port, same in-process moto state
    try:
        assert main(args + ["--resume", "auto"]) == 0
        out = capsys.readouterr().out
        assert "resumed from s3://midsave/run/ckpt/step_000000002 at step 2" in out
        assert sorted(train_losses(run_dir)) == [1, 2, 3, 4, 5, 6]
        done = json.loads(
            server.client().get_object(Bucket="midsave", Key="run/ckpt/DONE")["Body"].read()
        )
        assert done["step"] == 6
    finally:
        server.stop()
