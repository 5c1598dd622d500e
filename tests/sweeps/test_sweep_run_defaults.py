"""A sweep run, started with nothing but the sweep's own argv (no flags), checkpoints every
`checkpoint_every_steps` and logs to W&B (offline here, read back) under the run id derived
from the sweep and run name (issue 17)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from sweep_helpers import REPO, events, write_sweep

from gpn_scale.scaling.slurm_launch import load
from gpn_scale.train.metrics import read_jsonl
from gpn_scale.train.wandb_sink import read_offline_run

pytestmark = pytest.mark.slow


def test_sweep_run_checkpoints_every_n_and_logs_to_wandb_without_flags(tmp_path):
    sweep_path = write_sweep(
        tmp_path / "ci.yaml", checkpoint_root=str(tmp_path / "ckpt"), run_root=tmp_path / "runs"
    )
    run = load(str(sweep_path)).runs[0]
    argv = subprocess.run(
        [sys.executable, "-m", "gpn_scale.cli", "sweep", "run-argv", str(sweep_path), "0"],
        cwd=REPO,
        text=True,
        capture_output=True,
        check=True,
    ).stdout.split("\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true")
    proc = subprocess.run(
        [sys.executable, "-m", "gpn_scale.cli", "train", *[a for a in argv if a]],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run_dir = tmp_path / "runs" / run.name
    saved = [
        r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("event") == "checkpoint"
    ]
    assert saved == [4, 8, 12, 16], saved  # ci.yaml: checkpoint_every_steps 4, plus the final
    assert "preempted" not in events(run_dir)
    assert f"wandb sync {run_dir / 'wandb'}" in proc.stdout  # the upload command is logged
    wb = read_offline_run(run_dir / "wandb")
    assert wb.run_id == run.wandb_run_id
    assert sorted(r["_step"] for r in wb.history if "train/loss" in r) == list(range(1, 17))
