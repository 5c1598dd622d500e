"""A training run as the commands build it: `Trainer(cfg, callbacks=step_callbacks(cfg))`.

The trainer knows its step callbacks only by their protocol (gpn_scale/train/callbacks.py);
the ones a config asks for are attached here, above the trainer and evaluation both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpn_scale.run.config import TrainConfig
    from gpn_scale.train.callbacks import StepCallback


def step_callbacks(cfg: TrainConfig) -> list[StepCallback]:
    """What runs after each step of `cfg`'s run: the live state analyses
    (gpn_scale/eval/analysis/live.py) when analysis.every_steps > 0; else nothing."""
    if not cfg.analysis.every_steps:
        return []
    from gpn_scale.eval.analysis.live import LiveAnalyses

    return [LiveAnalyses(cfg.analysis)]
