"""Shared helpers of the sweep launch tests."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from gpn_scale.train.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
CI_SWEEP = REPO / "configs" / "sweeps" / "ci.yaml"


def write_sweep(
    path: Path,
    *,
    checkpoint_root: str,
    run_root: Path,
    models=None,
    seeds=None,
    overrides=(),
    name: str = "ci",
    tokens: int | None = None,
    remote: str | None = None,
) -> Path:
    """configs/sweeps/ci.yaml with its storage moved (S3 / tmp), optionally other models and
    data.remote (the session's one built corpus instead of a build per run folder)."""
    raw = OmegaConf.to_container(OmegaConf.load(CI_SWEEP))
    if remote is not None:
        raw["data"]["remote"] = remote
    raw["name"] = name
    raw["checkpoint_root"] = checkpoint_root
    raw["run_root"] = str(run_root)
    if models is not None:
        raw["models"] = models
    if seeds is not None:
        raw["seeds"] = seeds
    raw["defaults"]["overrides"] = list(overrides)
    if tokens is not None:
        raw["defaults"]["tokens"] = tokens
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(raw)))
    return path


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ with the venv first on PATH (what a user's login shell would have)."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    env["WANDB_MODE"] = "offline"
    env["WANDB_SILENT"] = "true"
    env.update(extra or {})
    return env


def losses(run_dir: Path) -> dict[int, float]:
    """train/loss by step from metrics.jsonl (a resumed run's later line wins)."""
    return {
        r["step"]: r["train/loss"]
        for r in read_jsonl(run_dir / "metrics.jsonl", live=True)
        if "train/loss" in r
    }


def events(run_dir: Path) -> list[str]:
    return [r["event"] for r in read_jsonl(run_dir / "metrics.jsonl", live=True) if "event" in r]


def wait_for(predicate, timeout: float, what: str, poll: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
