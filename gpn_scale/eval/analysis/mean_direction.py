"""The persistent mean direction s_bar = E_t[p_t]: size, stability, convergence, meaning.

Streamed: per-batch means (one d-vector per batch) and, for the running-mean convergence, the
sum over sequences of the unit running mean at each of the first K positions (K x d), so
cos(running mean at t, s_bar) averaged over sequences is exact once s_bar is known.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


class MeanDirectionAccumulator:
    """Feed each batch's steps with `step(p)` (B, d) in order, `end_batch()` after each."""

    def __init__(self, d: int, max_positions: int, device: torch.device | str = "cpu") -> None:
        self.d = d
        self.max_positions = max_positions
        self.unit_running = torch.zeros(max_positions, d, dtype=torch.float64, device=device)
        self.sequences = torch.zeros(max_positions, dtype=torch.float64, device=device)
        self.batch_means: list[Tensor] = []
        self._run: Tensor | None = None  # (B, d) this batch's per-sequence running sums
        self._i = 0

    def step(self, p: Tensor) -> None:
        p = p.to(torch.float64)
        self._run = p.clone() if self._run is None else self._run + p
        self._i += 1
        if self._i <= self.max_positions:
            unit = F.normalize(self._run, dim=-1)  # the running mean's direction
            self.unit_running[self._i - 1] += unit.sum(0)
            self.sequences[self._i - 1] += p.shape[0]

    def end_batch(self) -> Tensor:
        """This batch's per-sequence means (B, d); the batch mean is kept."""
        assert self._run is not None, "end_batch() before any step"
        seq_means = self._run / self._i
        self.batch_means.append(seq_means.mean(0))
        self._run, self._i = None, 0
        return seq_means


def mean_direction(
    acc: MeanDirectionAccumulator, mean: Tensor, mean_norm: float, level: float = 0.98
) -> dict[str, Any]:
    """Figures of s_bar = `mean` (from the covariance accumulator) and its convergence."""
    mean = mean.to(torch.float64)
    norm = float(mean.norm())
    means = torch.stack(acc.batch_means) if acc.batch_means else mean[None]
    unit = F.normalize(means, dim=-1)
    cos_to_global = unit @ (mean / max(norm, 1e-30))
    if means.shape[0] >= 2:
        pair = unit @ unit.T
        iu = torch.triu_indices(means.shape[0], means.shape[0], offset=1)
        pairwise = pair[iu[0], iu[1]]
        pairwise_mean, pairwise_min = float(pairwise.mean()), float(pairwise.min())
    else:
        pairwise_mean = pairwise_min = float("nan")
    seen = acc.sequences > 0
    curve = (acc.unit_running[seen] @ mean) / (acc.sequences[seen] * max(norm, 1e-30))
    reached = (curve >= level).nonzero()
    return {
        "norm": norm,
        "norm_rel_mean_state_norm": norm / mean_norm if mean_norm > 0 else float("nan"),
        "batches": int(means.shape[0]),
        "cos_between_batch_means": pairwise_mean,
        "cos_between_batch_means_min": pairwise_min,
        "cos_batch_mean_to_overall_min": float(cos_to_global.min()),
        "running_mean_cos": [float(c) for c in curve],
        "running_mean_level": level,
        # positions are counted from the first analysed state (t = 1): index 0 = 1 token
        "running_mean_tokens_to_level": int(reached[0]) + 1 if len(reached) else None,
    }


def spearman(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float:
    """Spearman rank correlation (ties take average ranks), via scipy."""
    from scipy.stats import spearmanr

    result = spearmanr(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))
    return float(result.statistic)


def decoded_distribution(
    logits: Tensor, unigram: np.ndarray | None, top: int = 10
) -> dict[str, Any]:
    """Top tokens of s_bar's decoded distribution and its rank agreement with the unigram."""
    logits = logits.detach().double().cpu()
    probs = torch.softmax(logits, dim=-1)
    k = min(top, logits.numel())
    values, ids = probs.topk(k)
    out: dict[str, Any] = {
        "top_ids": [int(i) for i in ids],
        "top_probs": [float(v) for v in values],
    }
    if unigram is not None:
        counts = np.asarray(unigram, dtype=np.float64)[: logits.numel()]
        if counts.shape[0] < logits.numel():
            counts = np.pad(counts, (0, logits.numel() - counts.shape[0]))
        lp = logits.numpy()
        out["spearman_unigram"] = spearman(lp, counts)
        seen = counts > 0
        out["spearman_unigram_seen"] = spearman(lp[seen], counts[seen]) if seen.sum() > 2 else None
        out["unigram_tokens"] = int(counts.sum())
    return out
