"""`train_step` (gpn_scale/train/step.py) against a fake `TrainModule` and the real
`PlainTrainModule` over a one-parameter model: the order of the train module's calls, gradient
accumulation over the micro-batches (the same update as one full batch), the non-finite skip (a
poisoned loss, another rank's NaN, a NaN gradient), clipping, the carried recurrent state and
autocast. No trainer, no process group: milliseconds each."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from gpn_scale.parallel.train_module import FSDP2TrainModule, PlainTrainModule
from gpn_scale.train.step import StepResult, train_step

CPU = torch.device("cpu")


def _alone(t: torch.Tensor) -> torch.Tensor:
    return t  # one rank: the mean over ranks is the value


def _no_autocast() -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


class Quadratic(nn.Module):
    """loss = mean((x @ w)^2): a gradient that depends on every row of the batch, so an
    accumulation that weights the micro-batches wrongly moves the update."""

    def __init__(self, nan_grad: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5, -1.0, 2.0]))
        self.nan_grad = nan_grad

    def forward(self, x: torch.Tensor, state: Any = None, return_state: bool = False) -> Any:
        loss = (x @ self.w).square().mean()
        if self.nan_grad:  # a finite loss (+0) whose gradient is 0 * inf = NaN
            loss = loss + torch.sqrt(self.w.abs() * 0).sum()
        return SimpleNamespace(loss=loss, state=None)


def _batches(n: int, rows: int = 2, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, 3, generator=g) for _ in range(n)]


def _plain(model: nn.Module, lr: float = 0.1) -> PlainTrainModule:
    return PlainTrainModule(model, torch.optim.SGD(model.parameters(), lr=lr))


def _step(train_module: Any, batches: Iterator[torch.Tensor], **kw: Any) -> StepResult:
    args: dict[str, Any] = {
        "lr": 0.1,
        "accum": 1,
        "grad_clip": 0.0,
        "device": CPU,
        "mean_over_ranks": _alone,
        "autocast": _no_autocast,
    }
    args.update(kw)
    return train_step(train_module, batches, **args)


# --------------------------------------------------------------------------- the protocol
class Recorder:
    """A TrainModule that records each call; its loss for micro-batch i is batch.sum()."""

    name = "fake"
    last_optim_s = 0.0

    def __init__(self, events: list[Any], applied: bool = True) -> None:
        self.events = events
        self.model = nn.Identity()
        self.applied = applied
        self.carries: list[Any] = []

    def before_step(self, lr: float) -> None:
        self.events.append(("before_step", lr))

    def forward_loss(
        self, tokens: torch.Tensor, state: Any = None, want_state: bool = False
    ) -> tuple[torch.Tensor, Any]:
        self.events.append(("forward", float(tokens.sum()), want_state))
        self.carries.append(state)
        new_state = tokens.clone().requires_grad_(True) * 1.0  # a non-leaf with a graph
        return tokens.sum().float(), new_state

    def backward(self, loss: torch.Tensor, accum: int, last_micro: bool) -> None:
        self.events.append(("backward", float(loss), accum, last_micro))

    def clip_and_step(self, grad_clip: float, lr: float, loss_finite: bool) -> tuple[float, bool]:
        self.events.append(("clip_and_step", grad_clip, lr, loss_finite))
        return 1.5, self.applied and loss_finite


def test_one_before_step_then_forward_backward_per_micro_batch_then_one_update():
    events: list[Any] = []
    batches = iter([torch.full((2,), float(i)) for i in range(1, 6)])
    r = _step(Recorder(events), batches, lr=0.25, accum=3, grad_clip=2.0)
    assert events == [
        ("before_step", 0.25),
        ("forward", 2.0, False),
        ("backward", 2.0, 3, False),
        ("forward", 4.0, False),
        ("backward", 4.0, 3, False),
        ("forward", 6.0, False),
        ("backward", 6.0, 3, True),  # only the last micro-batch syncs the gradients
        ("clip_and_step", 2.0, 0.25, True),
    ]
    assert r.loss == pytest.approx(4.0)  # the mean over the micro-batches
    assert (r.grad_norm, r.applied) == (1.5, True)
    assert torch.equal(r.last_batch, torch.full((2,), 3.0))
    assert float(next(batches)[0]) == 4.0  # exactly `accum` batches were taken


def test_the_loss_is_agreed_over_ranks_once_and_that_value_decides():
    seen: list[torch.Tensor] = []

    def other_rank_doubles(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.clone())
        return t * 2

    events: list[Any] = []
    batches = iter([torch.ones(1), torch.full((1,), 3.0)])
    r = _step(Recorder(events), batches, accum=2, mean_over_ranks=other_rank_doubles)
    assert len(seen) == 1 and float(seen[0]) == pytest.approx(2.0)  # loss_sum / accum
    assert r.loss == pytest.approx(4.0)

    def nan_elsewhere(t: torch.Tensor) -> torch.Tensor:
        return t * float("nan")

    events.clear()
    r = _step(Recorder(events), iter([torch.ones(1)]), mean_over_ranks=nan_elsewhere)
    assert events[-1] == ("clip_and_step", 0.0, 0.1, False)  # skipped on every rank
    assert not r.applied


def test_poison_makes_the_loss_nan_and_the_train_module_is_told_to_skip():
    events: list[Any] = []
    r = _step(Recorder(events), iter(_batches(2)), accum=2, poison=True)
    assert [e[3] for e in events if e[0] == "clip_and_step"] == [False]
    assert not r.applied
    assert r.loss != r.loss  # NaN


def test_autocast_wraps_each_forward_and_never_the_backward():
    events: list[Any] = []

    @contextlib.contextmanager
    def autocast() -> Iterator[None]:
        events.append("enter")
        yield
        events.append("exit")

    _step(Recorder(events), iter(_batches(2)), accum=2, autocast=autocast)
    kinds = [e if isinstance(e, str) else e[0] for e in events]
    assert kinds == [
        "before_step",
        *["enter", "forward", "exit", "backward"] * 2,
        "clip_and_step",
    ]


def test_stateful_windows_carry_the_detached_state_from_micro_batch_to_micro_batch():
    events: list[Any] = []
    train_module = Recorder(events)
    batches = [torch.full((2,), float(i)) for i in (1, 2, 3)]
    r = _step(train_module, iter(batches), accum=3, carry="c0", stateful=True)
    assert train_module.carries[0] == "c0"
    assert torch.equal(train_module.carries[1], batches[0]) and torch.equal(
        train_module.carries[2], batches[1]
    )
    assert all(e[2] is True for e in events if e[0] == "forward")  # want_state
    assert torch.equal(r.carry, batches[2])
    assert not r.carry.requires_grad and r.carry.grad_fn is None  # no graph across steps

    stateless = Recorder([])
    r = _step(stateless, iter(batches), accum=3, carry="c0", stateful=False)
    assert stateless.carries == ["c0", "c0", "c0"] and r.carry == "c0"


def test_timings_are_split_into_data_and_update():
    r = _step(Recorder([]), iter(_batches(3)), accum=3)
    assert r.data_s >= 0 and r.update_s >= 0
    parts = r.breakdown(step_s=1.0, optim_s=0.125)
    assert parts["time/optim_s"] == 0.125
    assert parts["time/data_s"] + parts["time/model_s"] + parts["time/update_s"] == pytest.approx(
        1.0
    )


# ----------------------------------------------------------------------- PlainTrainModule
def _reference_update(full: torch.Tensor, lr: float, clip: float) -> tuple[torch.Tensor, float]:
    """One SGD step of Quadratic on the whole batch: (the new weights, the pre-clip norm)."""
    ref = Quadratic()
    ref(full).loss.backward()
    assert ref.w.grad is not None
    norm = float(ref.w.grad.norm())
    grad = ref.w.grad * (min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0)
    return (ref.w - lr * grad).detach(), norm


@pytest.mark.parametrize("accum", [1, 2, 4])
def test_accumulating_micro_batches_is_one_step_on_the_whole_batch(accum):
    micro = _batches(accum, rows=8 // accum, seed=1)
    want, norm = _reference_update(torch.cat(micro), lr=0.1, clip=0.0)
    model = Quadratic()
    r = _step(_plain(model), iter(micro), accum=accum)
    assert r.applied
    assert r.grad_norm == pytest.approx(norm, rel=1e-5)
    assert torch.allclose(model.w.detach(), want, rtol=1e-6, atol=1e-7)
    assert model.w.grad is None  # zeroed for the next step


def test_the_gradient_is_clipped_and_the_pre_clip_norm_reported():
    micro = _batches(2, rows=4, seed=2)
    want, norm = _reference_update(torch.cat(micro), lr=0.1, clip=0.01)
    assert norm > 0.01  # the clip bites
    model = Quadratic()
    r = _step(_plain(model), iter(micro), accum=2, grad_clip=0.01)
    assert r.grad_norm == pytest.approx(norm, rel=1e-5)
    assert torch.allclose(model.w.detach(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("why", ["poisoned loss", "NaN on another rank", "NaN gradient"])
def test_a_non_finite_step_leaves_weights_and_optimizer_untouched(why):
    model = Quadratic(nan_grad=why == "NaN gradient")
    before = model.w.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_module = PlainTrainModule(model, opt)
    kw: dict[str, Any] = {"accum": 2}
    if why == "poisoned loss":
        kw["poison"] = True
    if why == "NaN on another rank":
        kw["mean_over_ranks"] = lambda t: t + float("nan")
    r = _step(train_module, iter(_batches(2)), **kw)
    assert not r.applied
    assert torch.equal(model.w.detach(), before)
    assert opt.state_dict()["state"] == {}  # Adam never stepped: no moments, no step count
    assert model.w.grad is None  # the bad gradient is not carried into the next step
    if why == "NaN gradient":
        assert r.loss == r.loss and r.grad_norm != r.grad_norm  # a finite loss, a NaN norm
    # The next, finite step trains from the untouched weights.
    model.nan_grad = False
    assert _step(train_module, iter(_batches(1)), lr=0.1).applied
    assert not torch.equal(model.w.detach(), before)


def test_fsdp2_syncs_gradients_only_on_the_last_micro_batch():
    syncs: list[bool] = []
    model = Quadratic()
    model.set_requires_gradient_sync = syncs.append  # type: ignore[attr-defined]
    train_module = FSDP2TrainModule(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _step(train_module, iter(_batches(3)), accum=3)
    assert syncs == [False, False, True]
