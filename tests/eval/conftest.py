"""Fixtures for the eval tests: real checkpoints written by the CheckpointManager (no training
run: a tiny model with perturbed weights, saved as the trainer saves it) and tiny datasets'
metadata naming the byte tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpn_scale.checkpoint import CheckpointManager
from gpn_scale.data.metadata import DatasetMetadata, SplitInfo, write_metadata
from gpn_scale.testing.models import perturbed_model, tiny_config


def byte_dataset(root: Path) -> str:
    """A dataset root holding only its metadata (the byte tokenizer); enough for eval."""
    meta = DatasetMetadata(
        vocab_size=257,
        seq_len=16,
        tokenizer={"kind": "byte", "name": "byte", "eod_token_id": 256},
        eod_token_id=256,
        splits={"train": SplitInfo(1, 16, 1), "val": SplitInfo(1, 16, 1)},
        source={"description": "test"},
        seed=0,
    )
    root.mkdir(parents=True, exist_ok=True)
    write_metadata(str(root), meta)
    return str(root)


def save_checkpoint(run_dir: Path, model: torch.nn.Module, data: str, step: int = 7) -> str:
    """A DCP checkpoint under run_dir/checkpoints as the trainer writes it (model + meta)."""
    mgr = CheckpointManager(str(run_dir / "checkpoints"))
    meta: dict[str, Any] = {
        "step": step,
        "tokens": step * 16,
        "model_config": model.config.to_dict(),
        "config": {"data": {"remote": data, "seq_len": 16}, "run_dir": str(run_dir)},
    }
    return mgr.save(step, {"model": model.state_dict()}, meta=meta)


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
