"""One optimizer step: accumulate the micro-batches, agree on the loss, clip and update."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from gpn_scale.parallel.train_module import TrainModule


@dataclass
class StepResult:
    loss: float  # mean over the micro-batches and the ranks
    grad_norm: float
    applied: bool  # False: a non-finite loss or gradient norm, the update was skipped
    last_batch: torch.Tensor  # the step's last micro-batch (the live analyses read it)
    carry: Any  # the recurrent state carried to the next window (train.stateful_windows)
    data_s: float  # fetching the batches
    update_s: float  # grad norm + clip + optimizer step

    def breakdown(self, step_s: float, optim_s: float) -> dict[str, float]:
        """Where the step's `step_s` seconds went: model = forward + backward (+ the loss
        all-reduce), update = grad norm + clip + optimizer step, optim = the optimizer step
        alone (`optim_s`), data = fetching the batches. The engine benchmark's step is
        model + optim; everything else is the trainer's overhead."""
        return {
            "time/data_s": self.data_s,
            "time/model_s": step_s - self.data_s - self.update_s,
            "time/update_s": self.update_s,
            "time/optim_s": optim_s,
        }


def train_step(
    train_module: TrainModule,
    batches: Iterator[torch.Tensor],
    *,
    lr: float,
    accum: int,
    grad_clip: float,
    device: torch.device,
    mean_over_ranks: Callable[[torch.Tensor], torch.Tensor],
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    carry: Any = None,
    stateful: bool = False,
    poison: bool = False,
) -> StepResult:
    """`poison` multiplies the loss by NaN (debug.inject_nan_*: the skip path's test)."""
    train_module.before_step(lr)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    data_s = 0.0
    for i in range(accum):
        t0 = time.perf_counter()
        tokens = next(batches).to(device, non_blocking=True)
        data_s += time.perf_counter() - t0
        with autocast():
            loss, new_carry = train_module.forward_loss(tokens, carry, want_state=stateful)
        if poison:
            loss = loss * float("nan")
        train_module.backward(loss, accum, last_micro=i == accum - 1)
        loss_sum += loss.detach().float()  # stays on the device: one sync per step
        if stateful and new_carry is not None:
            carry = new_carry.detach()
    loss_val = float(mean_over_ranks(loss_sum / accum))
    t0 = time.perf_counter()
    grad_norm, applied = train_module.clip_and_step(grad_clip, lr, math.isfinite(loss_val))
    return StepResult(loss_val, grad_norm, applied, tokens, carry, data_s, time.perf_counter() - t0)
