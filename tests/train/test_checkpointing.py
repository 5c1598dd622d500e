"""`RunCheckpoints.save` (gpn_scale/train/checkpointing.py) refusing or failing: weights
that are not finite, a lease another job took, a commit that fails in the storage. Each
leaves the previous checkpoint the newest and raises in one line; the trainer's
`TrainState.last_ckpt` is assigned only from a save that returned. (The manager's own
commit stages: tests/checkpoint/test_commit_protocol.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from gpn_scale.checkpoint import CheckpointError, CheckpointManager
from gpn_scale.checkpoint.lease import LeaseLost
from gpn_scale.parallel.train_module import PlainTrainModule
from gpn_scale.run.config import load_train_config
from gpn_scale.train.checkpointing import RunCheckpoints
from gpn_scale.train.state import TrainingError, TrainState

ONE_RANK: Any = SimpleNamespace(
    is_main=True, world_size=1, all_reduce_max=lambda v: v, barrier=lambda: None
)
NO_FAMILY: Any = SimpleNamespace(to_dict=dict)
LOADER: Any = SimpleNamespace(state_dict=lambda: {"position": 3})


class CountingModule(PlainTrainModule):
    def __init__(self) -> None:
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        super().__init__(model, torch.optim.SGD(model.parameters(), lr=0.1))
        self.saves = 0

    def save(self, mgr: Any, step: int, meta: dict, rank_state: dict, files: dict) -> str:
        self.saves += 1
        return super().save(mgr, step, meta, rank_state, files)


@pytest.fixture
def ckpt(tmp_path: Path) -> RunCheckpoints:
    cfg = load_train_config("ci_tiny", [f"run_dir={tmp_path / 'run'}"])
    mgr = CheckpointManager(str(tmp_path / "run" / "checkpoints"))
    return RunCheckpoints(
        cfg, ONE_RANK, mgr, lambda line: None, strategy="none",
        run_dir=str(tmp_path / "run"), resume="none", eval_only=False, fresh=False,
        take_over=False,
    )  # fmt: skip


def test_weights_that_are_not_finite_are_never_saved(ckpt):
    train_module = CountingModule()
    first = ckpt.save(train_module, TrainState(step=2), LOADER, NO_FAMILY)
    with torch.no_grad():
        train_module.model.weight[0, 0] = float("inf")
    with pytest.raises(TrainingError, match=r"^refusing to checkpoint at step 4: the weights are"):
        ckpt.save(train_module, TrainState(step=4), LOADER, NO_FAMILY)
    assert train_module.saves == 1  # the train module was never asked
    assert ckpt.mgr.latest() == first
    assert [s for s, _, _ in ckpt.mgr.list_checkpoints()] == [2]


def test_a_lease_taken_over_writes_nothing(ckpt):
    train_module = CountingModule()
    ckpt.lease = SimpleNamespace(check=lambda: "job 42 took this run over", lost=None)
    with pytest.raises(LeaseLost, match="job 42 took this run over"):
        ckpt.save(train_module, TrainState(step=2), LOADER, NO_FAMILY)
    assert train_module.saves == 0 and ckpt.mgr.list_checkpoints() == []
    ckpt.lease = None


def test_a_failed_commit_raises_and_keeps_the_previous_checkpoint(ckpt, monkeypatch):
    train_module = CountingModule()
    first = ckpt.save(train_module, TrainState(step=2), LOADER, NO_FAMILY)
    storage = ckpt.mgr.storage
    real = storage.put_bytes

    def no_manifest(key: str, data: bytes) -> None:
        if key.endswith("manifest.json"):
            raise CheckpointError("injected: the manifest could not be written")
        real(key, data)

    monkeypatch.setattr(storage, "put_bytes", no_manifest)
    with pytest.raises(CheckpointError, match=r"step_000000004 not saved .*injected") as err:
        ckpt.save(train_module, TrainState(step=4), LOADER, NO_FAMILY)
    assert "\n" not in str(err.value)
    assert CheckpointManager(ckpt.mgr.root).latest() == first
