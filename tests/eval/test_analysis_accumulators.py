"""The analyses' accumulators on planted states: known spectrum, rank, dead dimensions and
mean direction measured exactly, and every streamed figure equal to the all-at-once one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gpn_scale.eval.analysis.geometry import CovarianceAccumulator, geometry
from gpn_scale.eval.analysis.horizon import HorizonAccumulator
from gpn_scale.eval.analysis.mean_direction import MeanDirectionAccumulator, mean_direction
from gpn_scale.eval.analysis.memory import RetentionAccumulator, group_heads, lag_to_level

D, N = 24, 400


def planted_states(spectrum: list[float], mean: torch.Tensor, dead: int, seed: int = 0):
    """N x D states whose sample covariance is exactly Q diag(spectrum) Q^T, with the last
    `dead` coordinates constant and sample mean exactly `mean`."""
    g = torch.Generator().manual_seed(seed)
    k = len(spectrum)
    z = torch.randn(N, k, generator=g, dtype=torch.float64)
    z = z - z.mean(0)
    u, _ = torch.linalg.qr(z)  # orthonormal columns orthogonal to the ones vector
    q, _ = torch.linalg.qr(torch.randn(D - dead, k, generator=g, dtype=torch.float64))
    basis = torch.zeros(D, k, dtype=torch.float64)
    basis[: D - dead] = q
    lam = torch.tensor(spectrum, dtype=torch.float64)
    return math.sqrt(N) * u * lam.sqrt() @ basis.T + mean


def test_planted_spectrum_rank_dead_dims_and_mean():
    spectrum = [16.0, 4.0, 2.0, 1.0, 1.0, 0.5, 0.25, 0.25]
    mean = torch.zeros(D, dtype=torch.float64)
    mean[0] = 30.0  # a large mean direction, as in the paper (its size must not bias the cov)
    x = planted_states(spectrum, mean, dead=3)
    acc = CovarianceAccumulator(D)
    for chunk in x.split(37):  # streamed in uneven chunks
        acc.update(chunk)
    g = geometry(acc)
    lam = torch.tensor(spectrum, dtype=torch.float64)
    assert g["eigenvalues"][: len(spectrum)] == pytest.approx(spectrum, rel=1e-9)
    assert max(g["eigenvalues"][len(spectrum) :]) < 1e-9
    assert g["stable_rank"] == pytest.approx(float(lam.sum() / lam.max()), rel=1e-9)
    assert g["participation_ratio"] == pytest.approx(float(lam.sum() ** 2 / lam.pow(2).sum()))
    # cumulative shares 0.64 0.80 0.88 0.92 0.96 0.98 0.99 1.0: an exact 0.99 counts as reached
    assert (g["pcs_90"], g["pcs_99"]) == (4, 7)
    assert g["dead_dims"] == 3
    assert acc.mean.tolist() == pytest.approx(mean.tolist(), abs=1e-9)
    norms = x.norm(dim=1)
    assert g["mean_norm"] == pytest.approx(float(norms.mean()), rel=1e-12)
    assert g["std_norm"] == pytest.approx(float(norms.std(unbiased=False)), rel=1e-6)


def test_streamed_geometry_equals_all_at_once():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, D, generator=g, dtype=torch.float64)
    x = x @ torch.randn(D, D, generator=g, dtype=torch.float64) + 5.0
    acc = CovarianceAccumulator(D)
    for chunk in x.split(11):
        acc.update(chunk)
    g = geometry(acc)
    cov = torch.cov(x.T, correction=0)
    eig = torch.linalg.eigvalsh(cov).flip(0)
    assert g["eigenvalues"] == pytest.approx(eig.tolist(), rel=1e-8, abs=1e-9)
    std = cov.diagonal().sqrt()
    corr = cov / torch.outer(std, std)
    off = (corr.abs().sum() - D) / (D * (D - 1))
    assert g["mean_abs_offdiag_corr"] == pytest.approx(float(off), rel=1e-9)
    assert g["std_min"] == pytest.approx(float(std.min()), rel=1e-9)
    assert g["stable_rank"] == pytest.approx(float(eig.sum() / eig[0]), rel=1e-9)


def test_mean_direction_planted_and_running_mean_exact():
    B, T = 3, 12
    g = torch.Generator().manual_seed(2)
    direction = F.normalize(torch.randn(D, generator=g, dtype=torch.float64), dim=0) * 4.0
    batches = [
        direction + 0.5 * torch.randn(B, T, D, generator=g, dtype=torch.float64) for _ in range(4)
    ]
    cov = CovarianceAccumulator(D)
    acc = MeanDirectionAccumulator(D, max_positions=8)
    for b in batches:
        for t in range(T):
            acc.step(b[:, t])
        cov.update(b.reshape(-1, D))
        assert torch.allclose(acc.end_batch(), b.mean(1))
    md = mean_direction(acc, cov.mean, cov.norm_sum / cov.n)
    every = torch.cat([b.reshape(-1, D) for b in batches])
    s_bar = every.mean(0)
    assert md["norm"] == pytest.approx(float(s_bar.norm()), rel=1e-12)
    assert md["norm_rel_mean_state_norm"] == pytest.approx(
        float(s_bar.norm() / every.norm(dim=1).mean()), rel=1e-12
    )
    assert 0.8 < md["norm_rel_mean_state_norm"] < 1.0  # 4 / sqrt(16 + 0.25 * 24) ~ 0.85
    # Running mean: cos(mean of p_1..p_t of a sequence, s_bar), averaged over sequences.
    seqs = torch.cat(batches)  # (4B, T, D)
    run = seqs.cumsum(1)[:, :8] / torch.arange(1, 9, dtype=torch.float64)[None, :, None]
    want = F.cosine_similarity(run, s_bar.expand_as(run), dim=-1).mean(0)
    assert md["running_mean_cos"] == pytest.approx(want.tolist(), rel=1e-10)
    means = torch.stack([b.reshape(-1, D).mean(0) for b in batches])
    cos = F.cosine_similarity(means[:, None], means[None], dim=-1)
    iu = torch.triu_indices(4, 4, 1)
    assert md["cos_between_batch_means"] == pytest.approx(float(cos[iu[0], iu[1]].mean()))


@pytest.mark.parametrize("centered", [False, True])
def test_state_horizon_streamed_equals_direct(centered):
    B, T, K = 2, 20, 6
    p = torch.randn(B, T, D, generator=torch.Generator().manual_seed(3)) + 1.0
    center = p.mean(1) if centered else None
    acc = HorizonAccumulator(K)
    acc.reset(center)
    for t in range(T):
        acc.step(t, p[:, t])
    x = p - center[:, None] if centered else p
    want = [float(F.cosine_similarity(x[:, :-k], x[:, k:], dim=-1).mean()) for k in range(1, K + 1)]
    # float32 sums in two orders: a cosine near 0 (the centred states' at large lags, ~3e-4)
    # differs by ~4e-9, over 1e-5 of itself; the absolute bound is what float32 promises
    assert acc.curve() == pytest.approx(want, rel=1e-5, abs=1e-7)


def test_retention_streamed_equals_direct_and_lag_of_a_constant_decay():
    B, T, H, K = 2, 30, 3, 10
    alpha = torch.rand(B, T, H).double() * 0.5 + 0.5
    acc = RetentionAccumulator(H, K)
    acc.reset()
    for t in range(T):
        acc.step(t, alpha[:, t])
    curves = acc.curves()
    for k in range(1, K + 1):
        # write at t survives alpha_{t+1} ... alpha_{t+k}
        prods = torch.stack([alpha[:, t + 1 : t + k + 1].prod(1) for t in range(T - k)], 1)
        assert curves[:, k - 1].tolist() == pytest.approx(prods.mean((0, 1)).tolist(), rel=1e-10)
    lag = 7.3
    geometric = [math.exp(-k / lag) for k in range(1, 40)]
    assert lag_to_level(geometric) == pytest.approx(lag, rel=1e-12)
    assert lag_to_level([0.9, 0.8]) is None
    assert group_heads([1.2, 3.9, 4.1, None]) == ["fast", "fast", "slow", "slow"]
