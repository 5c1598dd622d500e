"""`ops/gpn_step/gemm.linear`'s low copy under Triton's interpreter: an epilogue that also
writes its result in the matmul dtype with the sums of squares per column block, and the
next GEMM that reads those as its A operand and takes its RMS scale from the sums. Held to
the same GEMM reading the float32 rows itself (`row_rms`), split over K and not."""

from __future__ import annotations

import pytest
import torch

from gpn_scale.ops.gpn_step import gemm, geometry


def _operands(dtype: torch.dtype, w_dtype: torch.dtype, M: int = 3, K: int = 40, N: int = 72):
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return (
        rand(M, K).to(dtype),  # A: the rows the fuse gate reads
        (rand(K, K) / K**0.5).to(w_dtype),  # the fuse gate's weight (K x K: a state)
        rand(K).to(dtype),
        rand(M, K).to(dtype),  # its residual and grounding input
        rand(M, K).to(dtype),
        (rand(K, N) / K**0.5).to(w_dtype),  # the next GEMM's weight
        rand(N).to(dtype),
    )


@pytest.mark.parametrize("K", [40, 600])  # 600: more blocks than the sums' loads take at once
@pytest.mark.parametrize("sms", [1, 64], ids=["unsplit", "split-K"])
@pytest.mark.parametrize(
    "dtype, w_dtype, rtol",
    [(torch.float64, torch.float64, 1e-12), (torch.float32, torch.bfloat16, 1e-5)],
    ids=["float64", "bf16-weights"],
)
def test_a_gemm_reading_the_low_copy_equals_it_reading_the_rows(
    K, sms, dtype, w_dtype, rtol, monkeypatch
):
    monkeypatch.setattr(geometry, "sm_count", lambda t: sms)
    a, w, bias, res, fuse, w_next, b_next = _operands(dtype, w_dtype, K=K)
    M, K = a.shape
    width = gemm.low_sums_width(a, w)
    plan = gemm.gemm_plan(M, K, K, a, 0, ieee=gemm.precision(w) == "ieee")
    assert (plan.splits > 1) == (sms > 1) and (width > 32) == (K > 512)
    assert width == geometry.cdiv(K, gemm.REDUCE_BLOCK_N if plan.splits > 1 else plan.block_n)
    state = torch.empty(M, K, dtype=dtype)
    low = torch.empty(M, K, dtype=w_dtype)
    sums = torch.full((M, width), float("nan"), dtype=dtype)  # every block written
    gemm.linear(a, w, state, "t", "fuse gate", bias=bias, row_rms=True, eps=1e-6,
                epilogue=2, res=res, fuse=fuse, low=(low, sums))  # fmt: skip
    plain = torch.empty_like(state)
    gemm.linear(a, w, plain, "t", "fuse gate", bias=bias, row_rms=True, eps=1e-6,
                epilogue=2, res=res, fuse=fuse)  # fmt: skip
    assert torch.equal(state, plain)  # the low copy changes nothing of the result
    assert torch.equal(low, state.to(w_dtype))  # rounded to nearest even, as .to rounds
    torch.testing.assert_close(sums.sum(1), state.pow(2).sum(1), rtol=rtol, atol=0)

    from_rows = torch.empty(M, w_next.shape[1], dtype=dtype)
    gemm.linear(state, w_next, from_rows, "t", "input", bias=b_next, row_rms=True, eps=1e-6)
    from_low = torch.empty_like(from_rows)
    gemm.linear(low, w_next, from_low, "t", "input", bias=b_next, split=(sums, K), eps=1e-6)
    torch.testing.assert_close(from_low, from_rows, rtol=rtol, atol=rtol)


def test_the_low_sums_must_have_the_writers_blocks():
    a, w, bias, res, fuse, *_ = _operands(torch.float64, torch.float64)
    state, low = torch.empty_like(a), torch.empty_like(a)
    with pytest.raises(AssertionError, match="sums' blocks"):
        gemm.linear(a, w, state, "t", "fuse gate", bias=bias, row_rms=True, eps=1e-6,
                    epilogue=2, res=res, fuse=fuse, low=(low, torch.empty(3, 1)))  # fmt: skip


@pytest.mark.parametrize("in_consumer", [False, True], ids=["summed", "partials"])
@pytest.mark.parametrize(
    "dtype, w_dtype", [(torch.float64, torch.float64), (torch.float32, torch.bfloat16)]
)
def test_a_wide_panel_split_product_equals_the_matmul(in_consumer, dtype, w_dtype, monkeypatch):
    """The wide-panel plan's tiles (`gemm.WIDE_PANEL_N` columns, 32-deep K, 5 stages), split
    over K with a partial last range and a masked last panel, under the interpreter."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(3, 200, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(200, 300, generator=g, dtype=torch.float64) / 200**0.5).to(w_dtype)
    plan = gemm.GemmPlan(16, gemm.WIDE_PANEL_N, 32, 1, splits=3, k_per_split=96, stages=5)
    monkeypatch.setattr(gemm, "gemm_plan", lambda *args, **kwargs: plan)
    out = torch.full((3, 300), float("nan"), dtype=dtype)
    partials = gemm.linear(a, w, out, "t", "input dy W^T", sum_in_consumer=in_consumer)
    got = partials.sum(0) if in_consumer else out
    # bf16 weights: the kernel's product of bf16-rounded A tiles, as the GPU's tensor cores
    want = (a.to(w_dtype).double() @ w.double()).to(dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
