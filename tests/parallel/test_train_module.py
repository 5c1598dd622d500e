"""`build_train_module` and the train modules of gpn_scale/parallel/train_module.py, at the
seams and in one process: the order the parallelism is applied in (tensor parallelism, then
FSDP2 or DeepSpeed ZeRO, then the optimizer over the wrapped model, once), with the steps
replaced by fakes that record their calls; and DeepSpeedTrainModule's step over a fake
engine. (test_parallel_strategies.py beside it runs the real strategies on several
processes; slow.)"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from gpn_scale.core.config import ConfigError
from gpn_scale.parallel import deepspeed as ds
from gpn_scale.parallel import fsdp
from gpn_scale.parallel.train_module import (
    DeepSpeedTrainModule,
    FSDP2TrainModule,
    ParallelPlan,
    PlainTrainModule,
    build_train_module,
    resolve_strategy,
)
from gpn_scale.train.step import train_step


def _plan(strategy: str, **kw: Any) -> ParallelPlan:
    return ParallelPlan(strategy, micro_batch=2, accum=3, global_batch=12, grad_clip=1.0,
                        bf16=False, **kw)  # fmt: skip


def _topo(tp: int) -> Any:
    return SimpleNamespace(tp_size=tp, tp_mesh="tp-mesh", dp_mesh="dp-mesh")


class Calls:
    """The fakes of each parallelism step, recording (what, the model it saw) in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.ds_config: dict[str, Any] = {}
        monkeypatch.setattr(fsdp, "apply_fsdp2", self._fsdp2)
        monkeypatch.setattr(ds, "prepare_env", lambda: self.log.append(("ds.prepare_env",)))
        monkeypatch.setattr(ds, "ds_config", self._ds_config)
        monkeypatch.setattr(ds, "wrap", self._wrap)

    def tp(self, model: nn.Module, mesh: Any) -> None:
        self.log.append(("tp", model, mesh))

    def _fsdp2(self, model: nn.Module, mesh: Any, **kw: Any) -> None:
        self.log.append(("fsdp2", model, mesh, kw["reduce_dtype"], kw["reshard_after_forward"]))

    def _ds_config(self, **kw: Any) -> dict[str, Any]:
        self.ds_config = kw
        return {"zero_optimization": {"stage": kw["zero_stage"]}}

    def _wrap(self, model: nn.Module, optimizer: Any, config: dict[str, Any]) -> Any:
        self.log.append(("ds.wrap", model, optimizer))
        engine = SimpleNamespace(module=model, optimizer="zero-opt")
        return engine, "zero-opt"

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        self.log.append(("optimizer", model))
        self.optimizers.append(opt)
        return opt


def test_fsdp2_comes_after_tp_and_the_optimizer_after_fsdp2(monkeypatch):
    calls, model = Calls(monkeypatch), nn.Linear(2, 2)
    plan = _plan("fsdp2", reduce_dtype="bf16", reshard_after_forward=False)
    train_module = build_train_module(
        model, plan, _topo(2), make_optimizer=calls.make_optimizer, apply_tp=calls.tp
    )
    assert calls.log == [
        ("tp", model, "tp-mesh"),
        ("fsdp2", model, "dp-mesh", "bf16", False),  # the plan's options reach fully_shard
        ("optimizer", model),  # over the sharded parameters, built once
    ]
    assert isinstance(train_module, FSDP2TrainModule)
    assert train_module.model is model and train_module.optimizer is calls.optimizers[0]


def test_deepspeed_wraps_after_tp_with_the_one_optimizer_built_for_it(monkeypatch):
    calls, model = Calls(monkeypatch), nn.Linear(2, 2)
    plan = _plan("deepspeed", zero_stage=2)
    train_module = build_train_module(
        model, plan, _topo(2), make_optimizer=calls.make_optimizer, apply_tp=calls.tp
    )
    opt = calls.optimizers[0]
    assert calls.log == [
        ("tp", model, "tp-mesh"),
        ("ds.prepare_env",),  # before `import deepspeed`
        ("optimizer", model),  # handed to deepspeed.initialize, which partitions its state
        ("ds.wrap", model, opt),
    ]
    assert calls.ds_config == {
        "global_batch": 12, "micro_batch": 2, "accum": 3, "grad_clip": 1.0,
        "zero_stage": 2, "bf16": False, "persistence_threshold": None,
    }  # fmt: skip
    assert isinstance(train_module, DeepSpeedTrainModule)
    assert train_module.optimizer == "zero-opt" and train_module.model is model


def test_zero3_says_how_many_parameters_it_partitioned(monkeypatch):
    calls, model = Calls(monkeypatch), nn.Linear(2, 2)
    model.weight.ds_tensor, model.weight.ds_numel = torch.zeros(2), 4  # type: ignore[attr-defined]
    model.bias.ds_tensor, model.bias.ds_numel = torch.zeros(2), 2  # type: ignore[attr-defined]
    lines: list[str] = []
    build_train_module(
        model, _plan("deepspeed", zero_stage=3), _topo(1),
        make_optimizer=calls.make_optimizer, log=lines.append,
    )  # fmt: skip
    assert lines == ["deepspeed: ZeRO-3 partitions 1 of 2 parameters"]


def test_one_process_builds_the_optimizer_once_and_no_parallelism(monkeypatch):
    calls, model = Calls(monkeypatch), nn.Linear(2, 2)
    train_module = build_train_module(
        model, _plan("none"), _topo(1), make_optimizer=calls.make_optimizer, apply_tp=calls.tp
    )
    assert calls.log == [("optimizer", model)]  # tp 1: the tp plan is not applied
    assert type(train_module) is PlainTrainModule and train_module.optimizer is calls.optimizers[0]


def test_tp_without_a_plan_and_an_unknown_strategy_fail_before_any_optimizer(monkeypatch):
    calls = Calls(monkeypatch)
    with pytest.raises(ConfigError, match=r"^parallel.tp: 2: this model has no tp plan; use tp 1"):
        build_train_module(
            nn.Linear(2, 2), _plan("fsdp2"), _topo(2), make_optimizer=calls.make_optimizer
        )
    with pytest.raises(ConfigError, match=r"parallel.backend: 'ddp' is not one of none, fsdp2"):
        build_train_module(
            nn.Linear(2, 2), _plan("ddp"), _topo(1), make_optimizer=calls.make_optimizer
        )
    assert calls.log == []


def test_resolve_strategy():
    assert resolve_strategy("auto", distributed=False) == "none"
    assert resolve_strategy("auto", distributed=True) == "fsdp2"
    assert resolve_strategy("deepspeed", distributed=False) == "deepspeed"
    with pytest.raises(ConfigError, match="none cannot run on several processes"):
        resolve_strategy("none", distributed=True)


# ---------------------------------------------------------------------- DeepSpeedTrainModule
class FakeEngine:
    """What DeepSpeedTrainModule asks of a DeepSpeed engine: it divides, clips and steps itself."""

    def __init__(self, events: list[Any], optimizer: Any, norm: float | None = 0.5) -> None:
        self.events, self.optimizer, self.norm = events, optimizer, norm
        self.module = nn.Identity()

    def __call__(self, tokens: torch.Tensor, state: Any = None, return_state: bool = False) -> Any:
        return SimpleNamespace(loss=tokens.float().mean(), state=None)

    def backward(self, loss: torch.Tensor) -> None:
        self.events.append(("engine.backward", float(loss)))

    def step(self) -> None:
        self.events.append(("engine.step", self.optimizer.param_groups[0]["lr"]))

    def get_global_grad_norm(self) -> float | None:
        return self.norm


def _ds_step(engine: FakeEngine, lr: float = 0.25) -> Any:
    train_module = DeepSpeedTrainModule(engine, engine.optimizer)
    return train_step(
        train_module, iter([torch.ones(2), torch.full((2,), 3.0)]), lr=lr, accum=2, grad_clip=1.0,
        device=torch.device("cpu"), mean_over_ranks=lambda t: t,
        autocast=contextlib.nullcontext,
    )  # fmt: skip


def test_deepspeed_sets_the_lr_before_the_engine_steps_and_steps_every_micro_batch():
    events: list[Any] = []
    opt = SimpleNamespace(param_groups=[{"lr": 0.0}, {"lr": 0.0}], overflow=False)
    r = _ds_step(FakeEngine(events, opt), lr=0.25)
    # engine.backward divides by the accumulation itself; engine.step only acts at the boundary
    assert events == [
        ("engine.backward", 1.0),
        ("engine.step", 0.25),
        ("engine.backward", 3.0),
        ("engine.step", 0.25),
    ]
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]
    assert (r.loss, r.grad_norm, r.applied) == (2.0, 0.5, True)


@pytest.mark.parametrize("why", ["overflow", "no norm", "nan norm"])
def test_deepspeed_reports_its_skipped_step(why):
    opt = SimpleNamespace(param_groups=[{"lr": 0.0}], overflow=why == "overflow")
    norm = {"overflow": 0.5, "no norm": None, "nan norm": float("nan")}[why]
    r = _ds_step(FakeEngine([], opt, norm=norm))
    assert not r.applied
