"""The chunkwise memory op equals the step-by-step recurrence, forward and backward."""

import pytest
import torch

from gpn_scale.ops.memory import memory_chunkwise, memory_recurrent


def _inputs(B=2, H=3, T=11, dk=5, dv=4, log_a_range=(-2.0, 0.0), seed=0):
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    q = torch.nn.functional.normalize(torch.randn(B, H, T, dk, generator=g, dtype=dt), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, H, T, dk, generator=g, dtype=dt), dim=-1)
    v = torch.randn(B, H, T, dv, generator=g, dtype=dt)
    lo, hi = log_a_range
    log_a = lo + (hi - lo) * torch.rand(B, H, T, generator=g, dtype=dt)
    b = torch.rand(B, H, T, generator=g, dtype=dt)
    M0 = torch.randn(B, H, dk, dv, generator=g, dtype=dt)
    return [t.requires_grad_() for t in (q, k, v, log_a, b, M0)]


@pytest.mark.parametrize("rule", ["gpn", "gdn"])
@pytest.mark.parametrize("chunk_size", [1, 4, 11, 16])
@pytest.mark.parametrize(
    "log_a_range",
    [(-2.0, 0.0), (-40.0, -20.0), (-1e-6, 0.0)],
    ids=["moderate", "near-zero-decay", "near-one-decay"],
)
def test_chunkwise_equals_recurrent(rule, chunk_size, log_a_range):
    inputs = _inputs(log_a_range=log_a_range)
    o_ref, M_ref = memory_recurrent(*inputs, rule=rule)
    o, M = memory_chunkwise(*inputs, rule=rule, chunk_size=chunk_size)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(M, M_ref, rtol=1e-10, atol=1e-12)
    g = torch.Generator().manual_seed(1)
    w_o = torch.randn(o.shape, generator=g, dtype=o.dtype)
    w_M = torch.randn(M.shape, generator=g, dtype=M.dtype)
    grads_ref = torch.autograd.grad((o_ref * w_o).sum() + (M_ref * w_M).sum(), inputs)
    grads = torch.autograd.grad((o * w_o).sum() + (M * w_M).sum(), inputs)
    for got, want in zip(grads, grads_ref):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_rules_differ_and_gdn_matches_its_definition():
    q, k, v, log_a, b, M0 = _inputs(T=3)
    o_gpn, _ = memory_recurrent(q, k, v, log_a, b, M0, rule="gpn")
    o_gdn, M_gdn = memory_recurrent(q, k, v, log_a, b, M0, rule="gdn")
    assert not torch.allclose(o_gpn, o_gdn)
    # Gated DeltaNet one step by hand: M1 = a (I - b k k^T) M0 + b k v^T.
    a = log_a[:, :, 0].exp()[..., None, None]
    kk = k[:, :, 0]
    eye = torch.eye(kk.shape[-1], dtype=kk.dtype)
    M1 = (
        a * ((eye - b[:, :, 0, None, None] * kk[..., :, None] * kk[..., None, :]) @ M0)
        + b[:, :, 0, None, None] * kk[..., :, None] * v[:, :, 0][..., None, :]
    )
    _, M_one = memory_recurrent(
        q[:, :, :1], k[:, :, :1], v[:, :, :1], log_a[:, :, :1], b[:, :, :1], M0, rule="gdn"
    )
    torch.testing.assert_close(M_one, M1)


def test_bad_arguments():
    inputs = _inputs(T=2)
    with pytest.raises(ValueError, match="rule"):
        memory_recurrent(*inputs, rule="mamba")
    with pytest.raises(ValueError, match="chunk_size"):
        memory_chunkwise(*inputs, chunk_size=0)
