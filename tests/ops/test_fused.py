"""The recompute's fused chains (gpn_scale/ops/gpn_step/fused.py): each Triton kernel (run by
the interpreter on CPU tensors here) equals the PyTorch form it replaces on CUDA, on the
operands as the recompute hands them (strided rows, the columns of one fused input row)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpn_scale.ops.backends import Request
from gpn_scale.ops.execution import execution
from gpn_scale.ops.gpn_step import fused

FORMS = [b.name for b in fused.BACKENDS.backends]


def _form(name: str) -> fused.Forms:
    return fused.BACKENDS.get(name).implementation(Request("cuda"))


def _y(read: int, ffn: int):
    """(C, B, width) fused input rows with the read gate's and the FFN's columns inside, and
    the normed read (C, B, read)."""
    g = torch.Generator().manual_seed(4)
    y = torch.randn(3, 2, 5 + read + 2 * ffn + 4, generator=g) * 3
    ro = torch.randn(3, 2, read, generator=g)
    rg = y[..., 5 : 5 + read]
    a, b = y[..., 5 + read : 5 + read + 2 * ffn].chunk(2, dim=-1)
    return rg, ro, a, b


@pytest.mark.parametrize("read", [0, 21], ids=["gpn", "gpn+m"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", FORMS)
def test_every_form_of_the_down_input_equals_the_functional_one(backend, dtype, read):
    rg, ro, a, b = _y(read, ffn=19)
    rg, ro = (rg, ro) if read else (None, None)
    want = F.silu(a) * b
    if read:
        want = torch.cat([F.silu(rg) * ro, want], dim=-1)
    with execution(triton_anywhere=True):
        got = _form(backend).down_input(rg, ro, a, b, dtype)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # float32 products rounded once to nearest even, as .to rounds
        torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("n", [7, 40])  # 40: more columns than the interpreter's block
@pytest.mark.parametrize("backend", FORMS)
def test_every_form_of_the_norm_equals_the_functional_one(backend, n):
    """From the states (B, C, n) read as (C, B, n) rows, as the recompute's first norm reads
    them: the normed rows, their bf16 copy (rounded to nearest even) and the rows' copy."""
    g = torch.Generator().manual_seed(5)
    S = torch.randn(2, 3, n, generator=g) * 4
    x = S.transpose(0, 1)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    out, copy = torch.empty(3, 2, n), torch.empty(3, 2, n)
    low = torch.empty(3, 2, n, dtype=torch.bfloat16)
    with execution(triton_anywhere=True):
        assert _form(backend).rms(x, 1e-6, out, low, copy) is out
        alone = torch.empty(3, 2, n)
        _form(backend).rms(x, 1e-6, alone)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(alone, out) and torch.equal(copy, x)
    assert torch.equal(low, out.to(torch.bfloat16))


def test_cpu_and_float64_keep_the_pytorch_forms():
    x = torch.ones(2, 3)
    assert fused.select(x) is fused.TORCH
    with execution(triton_anywhere=True):
        assert fused.select(x) is fused.TRITON
        assert fused.select(x.double()) is fused.TORCH


@pytest.mark.parametrize("backend", FORMS)
def test_every_form_of_the_heads_l2n_equals_the_functional_one(backend):
    """Per head of the query columns of fused input rows (a strided view), l2n(relu(x))."""
    g = torch.Generator().manual_seed(6)
    y = torch.randn(3, 2, 4 + 5 * 12 + 3, generator=g)
    pre = y[..., 4 : 4 + 5 * 12]  # 5 heads of 12
    x = F.relu(pre).view(3, 2, 5, 12)
    want = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    out = torch.empty(3, 2, 5, 12)
    with execution(triton_anywhere=True):
        assert _form(backend).l2n_relu(pre, out) is out
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", FORMS)
def test_every_form_of_the_adjoint_cast_equals_the_functional_one(backend):
    """An adjoint's rows in bf16 (to nearest even) and their column sums added to the bias
    gradient, over more rows and columns than one block."""
    g = torch.Generator().manual_seed(7)
    dy = torch.randn(37, 21, generator=g)
    db = torch.randn(21, generator=g)
    want = db + dy.sum(0)
    low = torch.empty(37, 21, dtype=torch.bfloat16)
    with execution(triton_anywhere=True):
        assert _form(backend).cast_with_sums(dy, low, db) is low
    assert torch.equal(low, dy.to(torch.bfloat16))
    torch.testing.assert_close(db, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", FORMS)
def test_every_form_of_the_weighted_norm_and_its_backward_equals_autograd(backend):
    """The decode's norm: rms(p) * w in bf16 with the rows' scales, and the gradient at p of
    rms(p) * w given the one at its output, against autograd."""
    g = torch.Generator().manual_seed(8)
    p = torch.randn(5, 37, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(37, generator=g, dtype=torch.float64)
    dy = torch.randn(5, 37, generator=g, dtype=torch.float64)
    y = p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    (want_dp,) = torch.autograd.grad(y, p, dy)
    p32, w32 = p.detach().float(), w.float()
    dp = torch.empty(5, 37)
    with execution(triton_anywhere=True):
        n, low, r = _form(backend).weighted_rms(p32, 1e-6, w32, torch.bfloat16)
        assert _form(backend).rms_back(dy.float(), n, r, w32, dp) is dp
    torch.testing.assert_close(n * w32, y.detach().float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(low, (n * w32).to(torch.bfloat16))
    torch.testing.assert_close(r, torch.rsqrt(p32.pow(2).mean(-1) + 1e-6), rtol=1e-6, atol=0)
    torch.testing.assert_close(dp, want_dp.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", FORMS)
def test_every_form_of_the_gated_residual_equals_the_functional_one(backend):
    """sigmoid(pg) * res + x with pg the gate columns of fused input rows (a strided view)."""
    g = torch.Generator().manual_seed(9)
    y = torch.randn(3, 2, 40, generator=g)
    pg, res, x = (
        y[..., 7:30],
        torch.randn(3, 2, 23, generator=g),
        torch.randn(3, 2, 23, generator=g),
    )
    out = torch.empty(3, 2, 23)
    with execution(triton_anywhere=True):
        assert _form(backend).gated_residual(pg, res, x, out) is out
    want = torch.sigmoid(pg) * res + x
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
