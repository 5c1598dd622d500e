"""W&B offline: the run holds the logged metrics (read back from its .wandb files) and a
resumed job continues the same run id (kept in the checkpoint)."""

from __future__ import annotations

import json

import pytest
from train_helpers import train_args

from gpn_scale.cli import main

pytestmark = pytest.mark.slow


def test_wandb_offline_run_holds_metrics_and_resume_keeps_run_id(corpus, tmp_path, monkeypatch):
    from gpn_scale.train.wandb_sink import read_offline_run

    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    wb = (
        "logging.wandb.mode=offline",
        "logging.wandb.project=gpn-test",
        "logging.wandb.entity=gpn-team",
        "logging.wandb.group=sweep-a",
        "logging.wandb.job_type=train",
        "run_name=r1",
        "checkpoint.every_steps=3",
        "schedule.warmup_steps=1",
    )
    assert main(train_args(corpus, run_dir, *wb, "schedule.total_steps=3")) == 0
    first = read_offline_run(run_dir)
    steps = [row.get("_step", row.get("step")) for row in first.history if "train/loss" in row]
    assert steps == [1, 2, 3]
    assert (first.project, first.entity, first.group, first.job_type, first.name) == (
        "gpn-test",
        "gpn-team",
        "sweep-a",
        "train",
        "r1",
    )
    assert first.config["optim"]["lr"] == 3e-3
    ckpt_meta = json.loads(
        (run_dir / "checkpoints" / "step_000000003" / "manifest.json").read_text()
    )["meta"]
    assert ckpt_meta["wandb_run_id"] == first.run_id

    assert (
        main(train_args(corpus, run_dir, *wb, "schedule.total_steps=5") + ["--resume", "auto"]) == 0
    )
    again = read_offline_run(run_dir, run_id=first.run_id)
    losses = {
        row.get("_step", row.get("step")): row["train/loss"]
        for row in again.history
        if "train/loss" in row
    }
    assert sorted(losses) == [1, 2, 3, 4, 5]
    jsonl = {
        r["step"]: r["train/loss"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "train/loss" in r
    }
    assert losses == pytest.approx(jsonl, rel=1e-6)
    assert len({p.split("/")[-1] for p in again.files}) == 1  # one run id, two processes
