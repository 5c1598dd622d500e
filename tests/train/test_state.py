"""`TrainState` (gpn_scale/train/state.py): a fresh run's position, and what of it a
checkpoint keeps: a save through `RunCheckpoints` and the real CheckpointManager (one
process, a tiny model, the test's own directory) restores step, tokens, skipped steps, the
W&B id and the checkpoint itself; the loop's own counters start over."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from gpn_scale.checkpoint import CheckpointManager
from gpn_scale.parallel.train_module import PlainTrainModule
from gpn_scale.run.config import load_train_config
from gpn_scale.train.checkpointing import RunCheckpoints
from gpn_scale.train.state import TrainState

ONE_RANK: Any = SimpleNamespace(
    is_main=True, world_size=1, all_reduce_max=lambda v: v, barrier=lambda: None
)
NO_FAMILY: Any = SimpleNamespace(to_dict=dict)  # no model config recorded: no shape check


class Loader:
    def __init__(self, position: int) -> None:
        self.position = position

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def test_a_fresh_run_starts_at_zero_with_nothing_carried():
    s = TrainState()
    assert (s.step, s.tokens, s.skipped, s.in_a_row) == (0, 0, 0, 0)
    assert s.wandb_id is None and s.last_ckpt is None and s.carry is None
    s.final_eval["eval/loss"] = 1.0
    assert TrainState().final_eval == {}  # each state its own dict


def _checkpoints(tmp_path: Path, resume: str) -> RunCheckpoints:
    cfg = load_train_config("ci_tiny", [f"run_dir={tmp_path / 'run'}"])
    mgr = CheckpointManager(str(tmp_path / "run" / "checkpoints"))
    return RunCheckpoints(
        cfg, ONE_RANK, mgr, lambda line: None, strategy="none",
        run_dir=str(tmp_path / "run"), resume=resume, eval_only=False, fresh=False,
        take_over=False,
    )  # fmt: skip


def _train_module(seed: int) -> PlainTrainModule:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    return PlainTrainModule(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_checkpoint_keeps_the_position_and_the_loop_counters_start_over(tmp_path):
    ckpt = _checkpoints(tmp_path, resume="none")
    saved = TrainState(
        step=7, tokens=7 * 512, skipped=2, wandb_id="w-123", last_ckpt=None, in_a_row=1,
        carry=torch.ones(2), final_eval={"eval/loss": 3.0},
    )  # fmt: skip
    source = _train_module(seed=0)
    uri = ckpt.save(source, saved, Loader(position=40), NO_FAMILY)
    assert uri.endswith("step_000000007")
    meta = ckpt.mgr.read_meta(uri)
    assert (meta["step"], meta["tokens"], meta["skipped_steps"], meta["wandb_run_id"]) == (
        7, 3584, 2, "w-123",
    )  # fmt: skip

    target, loader = _train_module(seed=1), Loader(position=0)
    restored = _checkpoints(tmp_path, resume=uri).restore(uri, target, loader, NO_FAMILY)
    assert restored == TrainState(step=7, tokens=3584, skipped=2, wandb_id="w-123", last_ckpt=uri)
    assert restored.in_a_row == 0 and restored.carry is None and restored.final_eval == {}
    assert loader.position == 40  # the data position comes back with it
    for a, b in zip(source.model.parameters(), target.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_no_checkpoint_to_resume_is_a_fresh_state(tmp_path):
    ckpt = _checkpoints(tmp_path, resume="auto")
    assert ckpt.restore(None, _train_module(0), Loader(0), NO_FAMILY) == TrainState()
