"""State horizon: E[cos(p_t, p_{t+k})] for k = 1..K, raw or around each sequence's mean.

A ring buffer holds each sequence's last K unit states (B x K x d, never B x T x d); every
new state is compared with all of them at once. The centered variant needs each sequence's
mean before its first pair, so it is a second pass over the same window (stream.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class HorizonAccumulator:
    """Feed `step(t, p)` for a batch in order; `reset(center)` before each batch."""

    def __init__(self, max_lag: int, device: torch.device | str = "cpu") -> None:
        self.max_lag = max_lag
        self.sums = torch.zeros(max_lag, dtype=torch.float64, device=device)
        self.counts = torch.zeros(max_lag, dtype=torch.float64, device=device)
        self._ring: Tensor | None = None
        self._times = torch.full((max_lag,), -1, dtype=torch.long, device=device)
        self._center: Tensor | None = None

    def reset(self, center: Tensor | None = None) -> None:
        """A new batch; `center` (B, d) is subtracted from every state of its sequences."""
        self._ring = None
        self._times.fill_(-1)
        self._center = center

    def step(self, t: int, p: Tensor) -> None:
        x = p.to(torch.float32)
        if self._center is not None:
            x = x - self._center.to(x.dtype)
        unit = F.normalize(x, dim=-1)
        K = self.max_lag
        if self._ring is None:
            self._ring = unit.new_zeros(unit.shape[0], K, unit.shape[1])
        filled = self._times >= 0
        if bool(filled.any()):
            cos = torch.einsum("bd,bkd->k", unit, self._ring).to(torch.float64)  # summed over B
            lags = t - self._times
            ok = filled & (lags >= 1) & (lags <= K)
            idx = (lags[ok] - 1).long()
            self.sums.index_add_(0, idx, cos[ok])
            self.counts.index_add_(0, idx, torch.full_like(cos[ok], float(unit.shape[0])))
        slot = t % K
        self._ring[:, slot] = unit
        self._times[slot] = t

    def curve(self) -> list[float | None]:
        """Mean cosine at lags 1..K (None where no pair was that far apart)."""
        return [
            float(s / c) if c > 0 else None
            for s, c in zip(self.sums.tolist(), self.counts.tolist(), strict=True)
        ]
