"""The cheap analyses, logged during training every `analysis.every_steps` steps.

A slice of the step's batch (analysis.rows x analysis.tokens) runs through the reference
step path without gradients; from it: the per-head memory half-lives (from the slice's mean
log decay, and from A_log / dt_bias alone), the stable rank of the slice's states and the
mean direction's norm relative to |p|. Cost: rows x tokens reference steps, nothing kept.
Collective under FSDP2 / ZeRO-3 (the weights are gathered on every rank for the slice).
`LiveAnalyses` is the trainer's step callback (gpn_scale/train/callbacks.py) that runs them;
gpn_scale/app/assemble.py attaches it to the runs the commands build.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from gpn_scale.eval.analysis.geometry import CovarianceAccumulator, stable_rank
from gpn_scale.eval.analysis.memory import half_life, param_decay

if TYPE_CHECKING:
    from gpn_scale.models.gpn import GPN
    from gpn_scale.run.config import AnalysisSection


@contextlib.contextmanager
def _full_weights(model: nn.Module) -> Iterator[None]:
    """The unsharded weights for the duration (FSDP2 unshard, DeepSpeed ZeRO-3 gather)."""
    fsdp: Any = model
    if hasattr(fsdp, "unshard") and hasattr(fsdp, "reshard"):  # FSDP2's FSDPModule
        fsdp.unshard()
        try:
            yield
        finally:
            fsdp.reshard()
    elif any(hasattr(p, "ds_id") for p in model.parameters()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            yield
    else:
        yield


class LiveAnalyses:
    """The step callback (train/callbacks.py's StepCallback) of `analysis.every_steps`: the
    live metrics every `settings.every_steps` steps (analysis.rows / analysis.tokens)."""

    def __init__(self, settings: AnalysisSection) -> None:
        self.settings = settings

    def after_step(self, model: nn.Module, batch: Tensor, step: int) -> dict[str, float]:
        every = self.settings.every_steps
        if not every or step % every:
            return {}
        return live_metrics(model, batch, self.settings)  # {}: not GPN


def head_key(prefix: str, h: int, n_heads: int) -> str:
    return f"{prefix}/head_{h:0{max(2, len(str(n_heads - 1)))}d}"


@torch.no_grad()
def live_metrics(model: nn.Module, tokens: Tensor, settings: Any) -> dict[str, float]:
    """{metric: value} for one training step's batch; {} for a model whose family has no
    state analyses (`FamilySpec.state_analyses`: GPN / GPN+M's reference step path)."""
    from gpn_scale.models.registry import family_of

    config = getattr(model, "config", None)
    if config is None or not family_of(config).state_analyses:
        return {}
    # A family with state analyses runs GPN's reference step path (its spec says so).
    gpn = cast("GPN", model)
    from gpn_scale.models.gpn.reference import reference_forward

    cfg = config
    x = tokens[: settings.rows, : settings.tokens]
    cov = CovarianceAccumulator(cfg.d_state, x.device)
    log_alpha: list[Tensor] = []

    def observe(rec) -> None:
        if rec.alpha is not None:
            log_alpha.append(torch.log(rec.alpha.double().clamp_min(1e-300)).mean(0))
        if rec.t > 0:  # p_0 is the zero state
            cov.update(rec.p)

    was_training = model.training
    model.eval()
    try:
        with _full_weights(model):
            reference_forward(gpn, x, on_step=observe)
            decay = (
                param_decay(gpn.write.A_log.detach(), gpn.write.dt_bias.detach())
                if gpn.write is not None
                else None
            )
    finally:
        model.train(was_training)
    eig = torch.linalg.eigvalsh(cov.covariance()).clamp_min(0)
    mean_norm = cov.norm_sum / cov.n
    out: dict[str, float | None] = {
        "analysis/stable_rank": stable_rank(eig),
        "analysis/mean_direction_norm": float(cov.mean.norm()),
        "analysis/mean_direction_rel_norm": float(cov.mean.norm()) / mean_norm
        if mean_norm > 0
        else math.nan,
    }
    if decay is not None and log_alpha:
        H = cfg.n_heads
        batch_hl = half_life(torch.exp(torch.stack(log_alpha).mean(0)))
        for h, (batch, param) in enumerate(zip(batch_hl, half_life(decay), strict=True)):
            out[head_key("half_life", h, H)] = batch
            out[head_key("half_life_param", h, H)] = param
    # A head that does not decay at all has no half-life: left out (JSON and W&B want numbers).
    return {k: v for k, v in out.items() if v is not None and math.isfinite(v)}
