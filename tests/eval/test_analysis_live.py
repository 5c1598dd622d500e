"""Live analyses in a tiny training run: per-head half-lives, stable rank and mean-direction
norm reach metrics.jsonl and a W&B offline run (read back), and training is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpn_scale.cli import main
from gpn_scale.core.config import ConfigError
from gpn_scale.run.config import load_train_config

SEQ_LEN = 64


def train(corpus: str, run_dir: Path, *overrides: str) -> list[dict]:
    args = ["train", "ci_tiny", f"data.remote={corpus}", f"data.seq_len={SEQ_LEN}"]
    args += [f"run_dir={run_dir}", "schedule.total_steps=2", "schedule.warmup_steps=1"]
    args += ["checkpoint.every_steps=0", "eval.at_end=false", *overrides]
    assert main(args) == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_live_analyses_in_metrics_and_wandb(tmp_path, private_tmpdir, monkeypatch, default_corpus):
    from gpn_scale.train.wandb_sink import read_offline_run

    corpus = default_corpus  # seq_len 64 = SEQ_LEN
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    plain = train(corpus, tmp_path / "plain")
    run_dir = tmp_path / "live"
    rows = train(
        corpus,
        run_dir,
        "analysis.every_steps=1",
        "analysis.rows=2",
        "analysis.tokens=32",
        "logging.wandb.mode=offline",
        "logging.wandb.project=gpn-test",
    )
    live = {r["step"]: r for r in rows if "analysis/stable_rank" in r}
    assert sorted(live) == [1, 2]
    keys = ("half_life/head_00", "half_life/head_01", "half_life_param/head_00")
    for r in live.values():
        assert all(r[k] > 0 for k in keys)
        assert r["analysis/stable_rank"] >= 1 and 0 < r["analysis/mean_direction_rel_norm"] <= 1
    # the analysis reads the model; it does not change what is trained
    losses = [{r["step"]: r["train/loss"] for r in rs if "train/loss" in r} for rs in (plain, rows)]
    assert losses[0] == losses[1]

    # FSDP2 (a 1-rank group here): the sharded weights are unsharded for the slice
    sharded = train(
        corpus,
        tmp_path / "fsdp2",
        "analysis.every_steps=1",
        "analysis.rows=2",
        "analysis.tokens=32",
        "parallel.backend=fsdp2",
    )
    sharded_live = {r["step"]: r for r in sharded if "analysis/stable_rank" in r}
    for step, r in live.items():
        for k in (*keys, "analysis/stable_rank"):
            assert sharded_live[step][k] == pytest.approx(r[k], rel=1e-5)

    wb = read_offline_run(run_dir)
    history = {row.get("_step", row.get("step")): row for row in wb.history if keys[0] in row}
    assert sorted(history) == [1, 2]
    for step, row in history.items():
        for k in (*keys, "analysis/stable_rank"):
            assert row[k] == pytest.approx(live[step][k], rel=1e-6)


@pytest.mark.parametrize(
    "override", ["analysis.every_steps=-1", "analysis.rows=0", "analysis.tokens=2"]
)
def test_analysis_settings_are_checked(override):
    with pytest.raises(ConfigError, match="analysis."):
        load_train_config("ci_tiny", [override])


def test_unknown_analysis_key_names_the_closest():
    with pytest.raises(ConfigError, match="every_steps"):
        load_train_config("ci_tiny", ["analysis.every_step=3"])
