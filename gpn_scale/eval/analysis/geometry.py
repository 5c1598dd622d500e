"""State geometry from a streamed covariance: spread, correlation, spectrum, effective rank.

Only d x d sums are kept (float64, around a fixed shift to avoid the cancellation a large mean
direction would cause in E[xx^T] - mm^T), so any number of states can be folded in, a chunk
at a time, and the result equals the all-at-once figures to rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


class CovarianceAccumulator:
    """Running n, sum and sum of outer products of rows of (N, d) chunks."""

    def __init__(self, d: int, device: torch.device | str = "cpu") -> None:
        self.d = d
        self.n = 0
        self.shift: Tensor | None = None  # the first chunk's mean
        self.sum = torch.zeros(d, dtype=torch.float64, device=device)
        self.outer = torch.zeros(d, d, dtype=torch.float64, device=device)
        self.norm_sum = 0.0
        self.norm_sq_sum = 0.0

    def update(self, x: Tensor) -> None:
        x = x.reshape(-1, self.d).to(torch.float64)
        if x.shape[0] == 0:
            return
        if self.shift is None:
            self.shift = x.mean(0)
        norms = x.norm(dim=1)
        self.norm_sum += float(norms.sum())
        self.norm_sq_sum += float(norms.pow(2).sum())
        y = x - self.shift
        self.sum += y.sum(0)
        self.outer += y.T @ y
        self.n += x.shape[0]

    @property
    def mean(self) -> Tensor:
        assert self.shift is not None and self.n > 0, "no states were added"
        return self.shift + self.sum / self.n

    def covariance(self) -> Tensor:
        """Population covariance (divides by n)."""
        assert self.n > 0, "no states were added"
        m = self.sum / self.n
        return self.outer / self.n - torch.outer(m, m)

    def second_moment(self) -> Tensor:
        """E[x x^T] (uncentered)."""
        mean = self.mean
        return self.covariance() + torch.outer(mean, mean)


def components_for(eigenvalues: Tensor, share: float) -> int:
    """Fewest leading principal components whose variance reaches `share` of the total."""
    lam = eigenvalues.clamp_min(0).sort(descending=True).values
    total = float(lam.sum())
    if total <= 0:
        return 0
    cum = torch.cumsum(lam, 0) / total
    # The small tolerance keeps an exact share (e.g. 9 of 10 equal eigenvalues = 0.9) at k.
    return int(torch.searchsorted(cum, torch.tensor(share - 1e-12, dtype=cum.dtype)).item()) + 1


def stable_rank(eigenvalues: Tensor) -> float:
    """||S||_F^2 / ||S||_2^2 of the (centered) state matrix = sum(lambda) / max(lambda)."""
    lam = eigenvalues.clamp_min(0)
    top = float(lam.max())
    return float(lam.sum()) / top if top > 0 else 0.0


def participation_ratio(eigenvalues: Tensor) -> float:
    """(sum lambda)^2 / sum lambda^2."""
    lam = eigenvalues.clamp_min(0)
    sq = float(lam.pow(2).sum())
    return float(lam.sum()) ** 2 / sq if sq > 0 else 0.0


def geometry(acc: CovarianceAccumulator, dead_tol: float = 1e-3) -> dict[str, Any]:
    """The paper's state-geometry figures from an accumulator.

    A dimension is dead when its std is at most `dead_tol` x the largest std (0 counts);
    correlations are taken over the live dimensions only (a dead one has none).
    """
    cov = acc.covariance()
    var = cov.diagonal().clamp_min(0)
    std = var.sqrt()
    top = float(std.max())
    dead = std <= dead_tol * top
    live = ~dead
    if int(live.sum()) >= 2:
        s = std[live]
        corr = cov[live][:, live] / torch.outer(s, s)
        k = corr.shape[0]
        off = corr.abs().sum() - corr.diagonal().abs().sum()
        mean_abs_corr = float(off) / (k * (k - 1))
    else:
        mean_abs_corr = float("nan")
    eig = torch.linalg.eigvalsh(cov).clamp_min(0).flip(0)
    eig_raw = torch.linalg.eigvalsh(acc.second_moment()).clamp_min(0).flip(0)
    mean_norm = acc.norm_sum / acc.n
    norm_var = max(acc.norm_sq_sum / acc.n - mean_norm**2, 0.0)
    return {
        "n_states": acc.n,
        "d": acc.d,
        "std_min": float(std.min()),
        "std_max": top,
        "std_median": float(std.median()),
        "dead_dims": int(dead.sum()),
        "dead_rule": f"std <= {dead_tol:g} x the largest std",
        "mean_abs_offdiag_corr": mean_abs_corr,
        "pcs_90": components_for(eig, 0.90),
        "pcs_99": components_for(eig, 0.99),
        "stable_rank": stable_rank(eig),
        "stable_rank_uncentered": stable_rank(eig_raw),
        "participation_ratio": participation_ratio(eig),
        "mean_norm": mean_norm,
        "std_norm": math.sqrt(norm_var),
        "eigenvalues": [float(v) for v in eig],
    }
