"""Non-finite steps are skipped and counted; persistent ones stop the run cleanly with the
last good checkpoint intact. Bad input fails with one line and writes nothing."""

from __future__ import annotations

import json

import pytest
from train_helpers import read_metrics, run_train, train_args, train_losses

from gpn_scale.cli import main


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("gpn-scale: error:")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.slow
def test_injected_nan_is_skipped_and_counted(corpus, tmp_path):
    run_dir = tmp_path / "run"
    run_train(
        corpus,
        run_dir,
        "schedule.total_steps=5",
        "checkpoint.every_steps=0",
        "debug.inject_nan_steps=[3]",
    )
    train = {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}
    assert sorted(train) == [1, 2, 3, 4, 5]
    assert train[3]["step_skipped"] is True and train[3]["skipped_steps"] == 1
    assert all(not train[s]["step_skipped"] for s in (1, 2, 4, 5))
    assert train[5]["skipped_steps"] == 1
    import math

    assert math.isfinite(train[4]["train/loss"]) and math.isfinite(train[5]["train/loss"])
    done = json.loads((run_dir / "checkpoints" / "DONE").read_text())
    assert done["skipped_steps"] == 1 and math.isfinite(done["final_eval_loss"])


@pytest.mark.slow
def test_persistent_nan_stops_cleanly_and_keeps_last_good_checkpoint(corpus, tmp_path):
    from gpn_scale.checkpoint import CheckpointManager
    from gpn_scale.train.signals import EXIT_NONFINITE

    run_dir = tmp_path / "run"
    args = (
        "schedule.total_steps=8",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=5",
        "train.max_nonfinite_in_a_row=2",
    )
    proc = run_train(corpus, run_dir, *args, "debug.inject_nan_from=5", check=False)
    assert proc.returncode == EXIT_NONFINITE, proc.stderr[-2000:]
    assert "2 consecutive steps had a non-finite loss or gradient" in proc.stdout + proc.stderr
    assert "step_000000004" in proc.stdout + proc.stderr  # names the last good checkpoint
    mgr = CheckpointManager(str(run_dir / "checkpoints"))
    assert mgr.latest().endswith("step_000000004")
    assert [s for s, _, ok in mgr.list_checkpoints() if ok] == [4, 2]
    assert not (run_dir / "checkpoints" / "DONE").exists()
    # The cause is gone (no injection): resuming continues from the good checkpoint.
    run_train(corpus, run_dir, *args, resume="auto")
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, 9))
    import math

    assert all(isinstance(v, float) and math.isfinite(v) for v in losses.values())


def test_unknown_config_key_is_one_line(capsys):
    assert main(["train", "ci_tiny", "optim.weight_decya=0.1"]) == 2
    line = _one_line_error(capsys)
    assert "optim.weight_decya: unknown config key (did you mean 'optim.weight_decay'?)" in line


def test_unwritable_checkpoint_path_is_one_line(corpus, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    run_dir = tmp_path / "run"
    rc = main(train_args(corpus, run_dir, f"checkpoint.root={blocker}/ckpt"))
    assert rc == 2
    line = _one_line_error(capsys)
    assert str(blocker) in line
    assert not (run_dir / "metrics.jsonl").exists()  # failed before any training


def test_missing_s3_credentials_is_one_line(corpus, tmp_path, capsys, s3_endpoint, monkeypatch):
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    run_dir = tmp_path / "run"
    rc = main(train_args(corpus, run_dir, "checkpoint.root=s3://some-bucket/ckpt"))
    assert rc == 2
    line = _one_line_error(capsys)
    assert "credential" in line.lower()
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_incompatible_checkpoint_is_one_line_and_kept(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert (
        main(
            train_args(
                corpus,
                run_dir,
                "schedule.total_steps=2",
                "schedule.warmup_steps=1",
                "eval.at_end=false",
            )
        )
        == 0
    )
    ckpts = run_dir / "checkpoints"
    before = sorted(p.name for p in ckpts.iterdir())
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    rc = main(
        train_args(
            corpus,
            run_dir,
            "schedule.total_steps=4",
            "schedule.warmup_steps=1",
            "model_overrides={d_ffn: 96}",
        )
        + ["--resume", "auto"]
    )
    assert rc == 2
    line = _one_line_error(capsys)
    assert "another model shape" in line and "d_ffn 320 != 96" in line
    assert sorted(p.name for p in ckpts.iterdir()) == before
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before
