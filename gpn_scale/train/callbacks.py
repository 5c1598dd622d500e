"""What the loop runs after each optimizer step besides its own metrics: step callbacks.

Whoever builds the run hands them to the Trainer (`Trainer(cfg, callbacks=...)`; the
commands do it through gpn_scale/app/assemble.py, which attaches the live state analyses of
gpn_scale/eval/analysis/live.py when `analysis.every_steps` asks for them). The loop knows
only this protocol, so the trainer imports nothing from evaluation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # no torch import for the protocol alone
    from torch import Tensor, nn


class StepCallback(Protocol):
    def after_step(self, model: nn.Module, batch: Tensor, step: int) -> dict[str, float]:
        """The metrics to log at `step` ({}: none this step), from the model the step just
        updated (the parallel wrapper's module: sharded under FSDP2 / ZeRO-3) and the step's
        last micro-batch. Called on every rank (it may be collective); only rank 0 logs."""
        ...
