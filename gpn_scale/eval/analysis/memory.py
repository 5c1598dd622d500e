"""Memory horizon per head: how long a write survives the decays that follow it.

Retention of a write at step t after k more steps is prod_{j=1..k} alpha_{t+j} (the decay
alone; the delta rule's overwrite is not counted). Its mean over held-out steps is streamed
from a ring of each sequence's last K cumulative log-decays (B x H x K). The lag where the
mean reaches 1/e is read off with log-linear interpolation, exact for a constant decay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

INV_E = math.exp(-1.0)
# Stated rule: a head is fast when its 1/e lag is at most this many tokens (the paper's
# split: 6 fast heads at 1-3 tokens, 9 slow ones at 5-322).
DEFAULT_FAST_LAG = 4.0


class RetentionAccumulator:
    """Feed `step(t, alpha)` (B, H) for a batch in order; `reset()` before each batch."""

    def __init__(self, n_heads: int, max_lag: int, device: torch.device | str = "cpu") -> None:
        self.n_heads, self.max_lag = n_heads, max_lag
        self.sums = torch.zeros(n_heads, max_lag, dtype=torch.float64, device=device)
        self.counts = torch.zeros(max_lag, dtype=torch.float64, device=device)
        self.log_alpha_sum = torch.zeros(n_heads, dtype=torch.float64, device=device)
        self.steps = 0
        self._ring: Tensor | None = None
        self._times = torch.full((max_lag,), -1, dtype=torch.long, device=device)
        self._cum: Tensor | None = None

    def reset(self) -> None:
        self._ring, self._cum = None, None
        self._times.fill_(-1)

    def step(self, t: int, alpha: Tensor) -> None:
        log_a = torch.log(alpha.to(torch.float64).clamp_min(1e-300))  # (B, H)
        B = log_a.shape[0]
        self.log_alpha_sum += log_a.sum(0)
        self.steps += B
        self._cum = log_a if self._cum is None else self._cum + log_a
        K = self.max_lag
        if self._ring is None:
            self._ring = log_a.new_zeros(B, self.n_heads, K)
        filled = self._times >= 0
        if bool(filled.any()):
            lags = t - self._times
            ok = filled & (lags >= 1) & (lags <= K)
            kept = torch.exp(self._cum[:, :, None] - self._ring[:, :, ok]).sum(0)  # (H, n_ok)
            idx = (lags[ok] - 1).long()
            self.sums.index_add_(1, idx, kept)
            self.counts.index_add_(0, idx, torch.full_like(idx, B, dtype=torch.float64))
        slot = t % K
        self._ring[:, :, slot] = self._cum  # the write at step t starts from here
        self._times[slot] = t

    def curves(self) -> Tensor:
        """(H, K) mean retention at lags 1..K (NaN where no pair was that far apart)."""
        return self.sums / self.counts.clamp_min(1) + torch.where(
            self.counts > 0, 0.0, float("nan")
        )

    def geometric_mean_alpha(self) -> Tensor:
        return torch.exp(self.log_alpha_sum / max(self.steps, 1))


def lag_to_level(curve: Sequence[float] | Tensor, level: float = INV_E) -> float | None:
    """First lag (lags are 1, 2, ...; lag 0 has retention 1) where the curve reaches `level`,
    interpolated linearly in log retention; None when it never does within the curve."""
    values = [float(v) for v in curve]
    prev_lag, prev = 0, 1.0
    target = math.log(level)
    for i, v in enumerate(values, start=1):
        if not math.isfinite(v):
            break
        if v <= level:
            lo, hi = math.log(max(prev, 1e-300)), math.log(max(v, 1e-300))
            frac = 1.0 if hi == lo else (lo - target) / (lo - hi)
            return prev_lag + frac * (i - prev_lag)
        prev_lag, prev = i, v
    return None


def group_heads(lags: Sequence[float | None], fast_lag: float = DEFAULT_FAST_LAG) -> list[str]:
    """'fast' when the 1/e lag is at most `fast_lag` tokens, else 'slow' (None = beyond the
    measured lags = slow)."""
    return ["fast" if lag is not None and lag <= fast_lag else "slow" for lag in lags]


def param_decay(A_log: Tensor, dt_bias: Tensor) -> Tensor:
    """Per-head alpha at a zero decay-projection input: exp(-exp(A_log) softplus(dt_bias))."""
    return torch.exp(-torch.exp(A_log.double()) * F.softplus(dt_bias.double()))


def half_life(alpha: Tensor) -> list[float | None]:
    """Steps for a constant per-step decay `alpha` to halve a write (None: no decay)."""
    rate = -torch.log(alpha.double().clamp(1e-300, 1.0))
    return [math.log(2.0) / r if r > 1e-15 else None for r in rate.tolist()]


def memory_horizon(acc: RetentionAccumulator, A_log: Tensor, dt_bias: Tensor, fast_lag: float):
    """The per-head report: 1/e lag, half-lives, fast/slow group, retention curves."""
    curves = acc.curves()
    lags = [lag_to_level(c) for c in curves]
    groups = group_heads(lags, fast_lag)
    gm = acc.geometric_mean_alpha()
    heads: list[dict[str, Any]] = []
    for h in range(acc.n_heads):
        heads.append(
            {
                "head": h,
                "lag_1e": lags[h],
                "group": groups[h],
                "half_life_mean_decay": half_life(gm[h : h + 1])[0],
                "half_life_param": half_life(param_decay(A_log[h : h + 1], dt_bias[h : h + 1]))[0],
                "mean_alpha": float(acc.sums.new_tensor(0) + gm[h]),
            }
        )
    return {
        "max_lag": acc.max_lag,
        "rule": f"fast = 1/e lag <= {fast_lag:g} tokens; slow otherwise "
        f"(including heads still above 1/e at lag {acc.max_lag})",
        "fast_heads": [h for h, g in enumerate(groups) if g == "fast"],
        "slow_heads": [h for h, g in enumerate(groups) if g == "slow"],
        "heads": heads,
        "retention": [[None if math.isnan(v) else v for v in c.tolist()] for c in curves],
    }
