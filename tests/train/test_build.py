"""`build_model` (gpn_scale/train/build.py): the order a run's model is built in, with the
family and the parallelism replaced by fakes that record their calls: the seed, the
family's module on the device, a warm start's weights before any sharding, then
`build_train_module` (TP, then FSDP2 / ZeRO, then the optimizer:
tests/parallel/test_train_module.py) with the run's optimizer, train mode, and a warm start's
optimizer state after the sharding."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from gpn_scale.models import registry
from gpn_scale.run.config import load_train_config
from gpn_scale.train import build

TOPO: Any = SimpleNamespace(device=torch.device("cpu"), tp_size=1)


class Recorded:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[Any] = []
        self.model = nn.Linear(4, 3)
        self.optimizer: Any = None
        self.plan: Any = None
        spec = SimpleNamespace(
            build=lambda cfg: self._note("spec.build", self.model),
            fsdp_units=lambda m: ["units"],
            apply_tp="the family's tp plan",
            compile_blocks=None,
            compile_fullgraph=True,
        )
        monkeypatch.setattr(registry, "family_of", lambda cfg: spec)
        monkeypatch.setattr(build, "seed_everything", lambda seed: self.log.append(("seed", seed)))
        monkeypatch.setattr(build, "build_train_module", self._build_train_module)

    def _note(self, what: str, value: Any) -> Any:
        self.log.append(what)
        return value

    def _build_train_module(self, model: nn.Module, plan: Any, topo: Any, **kw: Any) -> Any:
        self.plan = plan
        self.optimizer = kw["make_optimizer"](model)
        assert kw["fsdp_units"] == ["units"] and kw["apply_tp"] == "the family's tp plan"
        self.log.append("build_train_module")
        return SimpleNamespace(train=lambda mode: self.log.append(("train", mode)))

    def checkpoints(self) -> Any:
        return SimpleNamespace(
            load_initial_weights=lambda model, warm, spec, cfg: self.log.append("warm weights"),
            load_initial_optimizer=lambda train_module, warm: self.log.append("warm optimizer"),
        )


def _build(rec: Recorded, warm: Any, *overrides: str) -> tuple[Any, int]:
    cfg = load_train_config("ci_tiny", ["optim.lr=0.004", "seed=11", *overrides])
    return build.build_model(
        cfg, None, TOPO, "fsdp2", False, 2, 3, warm, rec.checkpoints(), lambda line: None
    )


def test_a_fresh_model_seed_build_parallelize_train(monkeypatch):
    rec = Recorded(monkeypatch)
    _, n_params = _build(rec, None)
    assert rec.log == [("seed", 11), "spec.build", "build_train_module", ("train", True)]
    assert n_params == 4 * 3 + 3
    assert isinstance(rec.optimizer, torch.optim.AdamW)
    assert rec.optimizer.param_groups[0]["lr"] == 0.004
    assert (rec.plan.strategy, rec.plan.micro_batch, rec.plan.accum) == ("fsdp2", 2, 3)


def test_warm_weights_load_before_the_sharding_and_the_optimizer_after(monkeypatch):
    rec = Recorded(monkeypatch)
    _build(rec, "warm source")  # initial_load_model_only: true (the default)
    assert rec.log == [
        ("seed", 11), "spec.build", "warm weights", "build_train_module", ("train", True),
        "warm optimizer",  # says what step 0 starts from
    ]  # fmt: skip


def test_a_warm_optimizer_loads_weights_and_state_after_the_sharding(monkeypatch):
    rec = Recorded(monkeypatch)
    _build(rec, "warm source", "checkpoint.initial_load_model_only=false")
    assert rec.log == [
        ("seed", 11), "spec.build", "build_train_module", ("train", True), "warm optimizer",
    ]  # fmt: skip
