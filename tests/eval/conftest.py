"""Fixtures for the eval tests (helpers in eval_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from eval_helpers import byte_dataset, save_checkpoint

from gpn_scale.testing.models import perturbed_model, tiny_config


@pytest.fixture(params=[True, False], ids=["gpn_m", "gpn"])
def byte_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    """A tiny GPN+M / GPN over the byte vocabulary (257), float32, non-trivial weights."""
    cfg = tiny_config(vocab_size=257, memory=request.param)
    return perturbed_model(cfg, dtype=torch.float32, scale=0.3).eval()


@pytest.fixture
def checkpoint(tmp_path: Path, byte_model: torch.nn.Module) -> str:
    data = byte_dataset(tmp_path / "data")
    return save_checkpoint(tmp_path / "run", byte_model, data)


@pytest.fixture
def gpn_m_checkpoint(tmp_path: Path) -> str:
    """One family only, for the slower CLI tests."""
    cfg = tiny_config(vocab_size=257)
    model = perturbed_model(cfg, dtype=torch.float32, scale=0.3).eval()
    return save_checkpoint(tmp_path / "run", model, byte_dataset(tmp_path / "data"))


@pytest.fixture(scope="session")
def finished_run(once_per_run) -> Path:
    """A finished `gpn-scale train ci_tiny run_dir=runs/x4` (2 steps, a checkpoint at each,
    the default corpus built inside the run folder), trained once per test run from its own
    working directory, as a user would. Tests copy it (run_helpers.copy_run), never change it."""
    import run_helpers

    def build(base: Path) -> None:
        run_helpers.train(base, "runs/x4")

    return once_per_run("finished_run", build) / "runs" / "x4"
