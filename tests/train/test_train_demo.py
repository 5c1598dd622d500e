"""`gpn-scale demo` (the README's main command), shortened: builds the embedded default
corpus, trains the tiny GPN+M on CPU, evaluates, and leaves checkpoint, metrics and PNG."""

from __future__ import annotations

import json
import subprocess

import pytest
from train_helpers import PY, REPO, child_env

pytestmark = pytest.mark.slow


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            PY,
            "-m",
            "gpn_scale",
            "demo",
            "--out",
            str(out),
            "--steps",
            "4",
            "eval.every_steps=2",
            "eval.batches=2",
            "checkpoint.every_steps=2",
        ],
        cwd=REPO,
        env=child_env(tmp_path),
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for name in ("checkpoint", "metrics", "loss curve", "config", "held-out loss"):
        assert name in proc.stdout
    png = out / "loss_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval/loss" in r] == [2, 4]
    done = json.loads((out / "checkpoints" / "DONE").read_text())
    assert done["step"] == 4 and done["final_eval_loss"] < 6.3  # below uniform over 512 ids
    assert (out / "checkpoints" / "step_000000004" / "manifest.json").exists()
    # Pipes, no terminal: plain progress lines to the end instead of the tqdm bar.
    assert "step 4/4 | loss" in proc.stdout and "step/s" not in proc.stderr
