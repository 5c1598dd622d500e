"""A GPN+M with planted per-head decays (A_log, dt_bias, zeroed decay projection): the memory
horizon, the half-lives and the fast/slow split are recovered, offline and live; the
reference step hook observes without changing the result."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from gpn_scale.eval.analysis.live import live_metrics
from gpn_scale.eval.analysis.stream import NO_MEMORY, AnalysisOptions, analyze_states, decode_state
from gpn_scale.models.gpn.config import GPNConfig
from gpn_scale.models.gpn.gpn import GPN
from gpn_scale.models.gpn.reference import reference_forward

LAGS = [1.5, 3.0, 12.0, 40.0]  # planted 1/e lags (tokens): two fast heads, two slow


def tiny(memory: bool = True) -> GPN:
    torch.manual_seed(0)
    heads = {"n_heads": len(LAGS), "d_key": 8, "d_value": 8} if memory else {}
    return GPN(GPNConfig(vocab_size=64, d_state=32, d_emb=16, d_ffn=48, memory=memory, **heads))


def plant(model: GPN) -> None:
    """alpha_h = exp(-exp(A_log) softplus(dt_bias)) = exp(-1 / lag_h) at every step."""
    w = model.write
    with torch.no_grad():
        w.decay.weight.zero_()
        w.dt_bias.fill_(math.log(math.e - 1.0))  # softplus = 1
        w.A_log.copy_(torch.log(1.0 / torch.tensor(LAGS)))


def windows(n: int = 3, B: int = 2, T: int = 96) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (B, T), generator=g) for _ in range(n)]


def test_planted_half_lives_recovered_and_grouped():
    model = tiny()
    plant(model)
    result = analyze_states(model, windows(), AnalysisOptions(max_lag=16))
    mem = result["memory_horizon"]
    got = [h["lag_1e"] for h in mem["heads"]]
    assert got == pytest.approx(LAGS, rel=1e-6)
    for h, lag in zip(mem["heads"], LAGS, strict=True):
        assert h["half_life_param"] == pytest.approx(lag * math.log(2), rel=1e-6)
        assert h["half_life_mean_decay"] == pytest.approx(lag * math.log(2), rel=1e-6)
    assert (mem["fast_heads"], mem["slow_heads"]) == ([0, 1], [2, 3])
    assert "1/e lag <= 4" in mem["rule"]
    assert result["windows"] == 6 and result["geometry"]["n_states"] == 6 * 95


def test_live_half_lives_match_the_planted_ones():
    model = tiny()
    plant(model)
    tokens = windows(1, B=6, T=40)[0]
    out = live_metrics(model, tokens, SimpleNamespace(rows=3, tokens=20))
    for h, lag in enumerate(LAGS):
        assert out[f"half_life/head_{h:02d}"] == pytest.approx(lag * math.log(2), rel=1e-6)
        assert out[f"half_life_param/head_{h:02d}"] == pytest.approx(lag * math.log(2), rel=1e-6)
    assert out["analysis/stable_rank"] >= 1.0
    assert 0 < out["analysis/mean_direction_rel_norm"] <= 1.0
    assert model.training  # the train/eval mode is put back


def test_gpn_without_memory_skips_the_memory_horizon_with_a_reason():
    result = analyze_states(tiny(memory=False), windows(1), AnalysisOptions(max_lag=8))
    assert result["memory_horizon"] == {"skipped": NO_MEMORY}
    assert result["geometry"]["n_states"] == 2 * 95


def test_step_hook_sees_the_decoded_states_and_changes_nothing():
    model = tiny()
    tokens = windows(1, B=2, T=10)[0]
    seen = []
    with torch.no_grad():
        plain = reference_forward(model, tokens, return_logits=True)
        hooked = reference_forward(model, tokens, return_logits=True, on_step=seen.append)
    assert torch.equal(plain.logits, hooked.logits) and torch.equal(plain.loss, hooked.loss)
    assert [r.t for r in seen] == list(range(10))
    assert all(r.alpha is not None and r.alpha.shape == (2, len(LAGS)) for r in seen)
    for r in seen:  # p_t is the state whose decoding gives the logits of x_t
        torch.testing.assert_close(decode_state(model, r.p), plain.logits[:, r.t])
    assert float(seen[0].p.abs().max()) == 0.0  # p_0 comes from the zero carry


def test_streamed_analysis_of_a_model_equals_all_at_once():
    """The driver (chunked covariance, two-pass centered horizon, running mean) against the
    same figures computed from every state of every window held at once."""
    import torch.nn.functional as F

    model = tiny()
    batches = windows(2, B=3, T=24)
    K = 6
    result = analyze_states(model, batches, AnalysisOptions(max_lag=K, chunk_steps=5))
    states = []
    with torch.no_grad():
        for tokens in batches:
            seen = []
            reference_forward(model, tokens, on_step=seen.append)
            states.append(torch.stack([r.p for r in seen[1:]], 1).double())  # (B, T-1, d)
    p = torch.cat(states)
    flat = p.reshape(-1, p.shape[-1])
    eig = torch.linalg.eigvalsh(torch.cov(flat.T, correction=0)).flip(0)
    geo = result["geometry"]
    assert geo["eigenvalues"] == pytest.approx(eig.tolist(), rel=1e-5, abs=1e-9)
    assert geo["stable_rank"] == pytest.approx(float(eig.sum() / eig[0]), rel=1e-6)
    assert geo["participation_ratio"] == pytest.approx(float(eig.sum() ** 2 / eig.pow(2).sum()))
    for key, x in (("raw", p), ("centered", p - p.mean(1, keepdim=True))):
        want = [
            float(F.cosine_similarity(x[:, :-k], x[:, k:], dim=-1).mean()) for k in range(1, K + 1)
        ]
        assert result["state_horizon"][key] == pytest.approx(want, rel=1e-4, abs=1e-6)
    s_bar = flat.mean(0)
    md = result["mean_direction"]
    assert md["norm_rel_mean_state_norm"] == pytest.approx(
        float(s_bar.norm() / flat.norm(dim=1).mean()), rel=1e-6
    )
    run = p.cumsum(1) / torch.arange(1, p.shape[1] + 1, dtype=p.dtype)[None, :, None]
    want_run = F.cosine_similarity(run, s_bar.expand_as(run), dim=-1).mean(0)
    assert md["running_mean_cos"] == pytest.approx(want_run.tolist(), rel=1e-5)
    assert md["top_ids"] == decode_state(model, s_bar.float()).topk(10).indices.tolist()
