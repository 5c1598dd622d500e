"""logging.wandb.mode=auto (what sweeps use): with no reachable W&B server the run logs
offline instead of failing, and prints the `wandb sync` command that uploads it later."""

from __future__ import annotations

import pytest
from train_helpers import child_env, run_train

from gpn_scale.train.wandb_sink import read_offline_run

pytestmark = pytest.mark.slow


def test_auto_falls_back_to_offline_and_prints_the_sync_command(corpus, tmp_path):
    run_dir = tmp_path / "run"
    env = child_env(tmp_path, WANDB_BASE_URL="http://127.0.0.1:9", WANDB_API_KEY="x" * 40)
    env.pop("WANDB_MODE", None)
    proc = run_train(
        corpus,
        run_dir,
        "schedule.total_steps=2",
        "logging.wandb.mode=auto",
        "logging.wandb.init_timeout=5",
        "logging.wandb.run_id=auto-run-1",
        env=env,
    )
    assert "logging.wandb.mode=auto: offline instead" in proc.stdout, proc.stdout[-2000:]
    assert f"wandb sync {run_dir / 'wandb'}" in proc.stdout
    wb = read_offline_run(run_dir / "wandb")
    assert wb.run_id == "auto-run-1"
    assert sorted(r["_step"] for r in wb.history if "train/loss" in r) == [1, 2]
