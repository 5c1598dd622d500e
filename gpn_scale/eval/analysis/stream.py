"""One streamed pass over held-out windows feeding every state analysis.

Each batch of windows runs through the reference step path (gpn_scale/models/gpn/reference.py),
whose `on_step` hook hands over p_t and the per-head decay alpha_t; the accumulators keep
only bounded summaries (d x d, K x d, B x K x d), never the batch's B x T x d states. The
centered state horizon needs each sequence's mean first, so it reruns the batch (a second
pass); `centered_horizon=False` skips it.

Position 0 is left out of the state analyses: its p is computed from the all-zero carry
and is exactly zero (no direction, no cosine). Its decay still counts for the memory.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from gpn_scale.eval.analysis.geometry import CovarianceAccumulator, geometry
from gpn_scale.eval.analysis.horizon import HorizonAccumulator
from gpn_scale.eval.analysis.mean_direction import (
    MeanDirectionAccumulator,
    decoded_distribution,
    mean_direction,
)
from gpn_scale.eval.analysis.memory import DEFAULT_FAST_LAG, RetentionAccumulator, memory_horizon
from gpn_scale.models.gpn.reference import StepRecord, reference_forward

NO_MEMORY = "GPN without memory: no memory heads, so no memory horizon"


@dataclass(frozen=True)
class AnalysisOptions:
    max_lag: int = 256  # state horizon lags 1..K (capped at the window's T - 2)
    memory_max_lag: int | None = None  # memory horizon lags (default: T - 1)
    running_mean_positions: int = 256  # running-mean convergence over the first K positions
    fast_lag: float = DEFAULT_FAST_LAG
    dead_tol: float = 1e-3
    centered_horizon: bool = True
    chunk_steps: int = 64  # states folded into the covariance this many steps at a time


def decode_state(model: Any, p: Tensor) -> Tensor:
    """Logits of a state through the tied decoder: (rms(p; w_dec) @ W_dec [+ b]) @ E^T."""
    from gpn_scale.models.gpn.reference import rms_norm

    cfg = model.config
    p = p.to(model.decode.weight.dtype)
    z = F.linear(
        rms_norm(p, model.decode_norm_weight, cfg.norm_eps), model.decode.weight, model.decode.bias
    )
    return F.linear(z, model.embedding.weight)


def accumulator_bytes(
    d: int, n_heads: int, batch: int, max_lag: int, memory_lag: int, positions: int, batches: int
) -> int:
    """Bytes the accumulators hold (float64 sums, float32 rings), whatever the data size."""
    cov = 2 * d * d * 8 + 4 * d * 8  # outer products and the covariance built from them
    horizon = 2 * batch * max_lag * d * 4  # raw and centered rings
    running = positions * d * 8 + batch * d * 8
    memory = batch * n_heads * memory_lag * 8 + n_heads * memory_lag * 8
    return cov + horizon + running + memory + batches * d * 8


@torch.no_grad()
def analyze_states(
    model: Any,
    batches: Iterable[Tensor],
    options: AnalysisOptions = AnalysisOptions(),
    *,
    device: torch.device | str = "cpu",
    unigram: np.ndarray | None = None,
) -> dict[str, Any]:
    """Every analysis over `batches` of (B, T) token windows; a JSON-ready dict."""
    model.eval()
    cfg = model.config
    d = cfg.d_state
    stream = iter(batches)
    first = next(stream, None)
    if first is None:
        raise ValueError("no held-out windows to analyse (is the split empty?)")
    B0, T0 = first.shape
    if T0 < 3:
        raise ValueError(f"windows of {T0} tokens: the analyses need at least 3")
    lag = min(options.max_lag, T0 - 2)
    cov = CovarianceAccumulator(d, device)
    mean_acc = MeanDirectionAccumulator(d, min(options.running_mean_positions, T0 - 1), device)
    raw = HorizonAccumulator(lag, device)
    centered = HorizonAccumulator(lag, device) if options.centered_horizon else None
    retention = (
        RetentionAccumulator(cfg.n_heads, min(options.memory_max_lag or T0 - 1, T0 - 1), device)
        if cfg.memory
        else None
    )
    chunk: list[Tensor] = []

    def first_pass(rec: StepRecord) -> None:
        if retention is not None and rec.alpha is not None:
            retention.step(rec.t, rec.alpha)
        if rec.t == 0:
            return
        chunk.append(rec.p)
        if len(chunk) >= options.chunk_steps:
            cov.update(torch.cat(chunk))
            chunk.clear()
        mean_acc.step(rec.p)
        raw.step(rec.t, rec.p)

    def second_pass(rec: StepRecord) -> None:
        if rec.t > 0 and centered is not None:
            centered.step(rec.t, rec.p)

    loss_sum, tokens_seen, windows = 0.0, 0, 0
    for tokens in itertools.chain([first], stream):
        tokens = tokens.to(device)
        B, T = tokens.shape
        if T != T0:
            raise ValueError(f"windows of {T} tokens after windows of {T0}: use one length")
        raw.reset()
        if retention is not None:
            retention.reset()
        out = reference_forward(model, tokens, on_step=first_pass)
        if chunk:
            cov.update(torch.cat(chunk))
            chunk.clear()
        seq_means = mean_acc.end_batch()
        if centered is not None:
            centered.reset(seq_means)
            reference_forward(model, tokens, on_step=second_pass)
        loss_sum += float(out.loss) * B * T
        tokens_seen += B * T
        windows += B

    geo = geometry(cov, options.dead_tol)
    mean = cov.mean
    md = mean_direction(mean_acc, mean, geo["mean_norm"])
    md.update(decoded_distribution(decode_state(model, mean.float()), unigram))
    memory: dict[str, Any]
    if retention is not None:
        w = model.write
        memory = memory_horizon(retention, w.A_log.detach(), w.dt_bias.detach(), options.fast_lag)
    else:
        memory = {"skipped": NO_MEMORY}
    loss = loss_sum / tokens_seen
    return {
        "windows": windows,
        "window_tokens": T0,
        "batch_size": B0,
        "tokens": tokens_seen,
        "heldout_loss": loss,
        "heldout_ppl": math.exp(min(loss, 700.0)),
        "positions": f"1..{T0 - 1} of each window (p_0 is the zero state)",
        "geometry": geo,
        "mean_direction": md,
        "state_horizon": {
            "lags": list(range(1, raw.max_lag + 1)),
            "raw": raw.curve(),
            "centered": centered.curve() if centered is not None else None,
        },
        "memory_horizon": memory,
        "accumulator_bytes": accumulator_bytes(
            d,
            cfg.n_heads if cfg.memory else 0,
            B0,
            raw.max_lag,
            retention.max_lag if retention is not None else 0,
            mean_acc.max_positions,
            len(mean_acc.batch_means),
        ),
    }
