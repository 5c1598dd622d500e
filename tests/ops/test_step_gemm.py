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


def _both_routes(call, out: torch.Tensor, projection: str = "down"):
    """`call(out, workspace)` through the Triton GEMM and again through cuBLAS: the two
    outputs, each starting as NaN (every element written)."""
    from gpn_scale.ops.launch import recording

    outs = []
    for cublas in (frozenset(), frozenset({projection})):
        o = torch.full_like(out, float("nan"))
        with recording() as launches:
            call(o, gemm.SplitWorkspace(o, cublas))
        assert any(x.cublas for x in launches) == bool(cublas)  # the route it was sent
        outs.append(o)
    return outs


# (dtype, weight dtype, tolerance): float64, and bf16 weights whose products both routes
# take of bf16-rounded A rows (exact in float32), summed in other orders
ROUTE_DTYPES = pytest.mark.parametrize(
    "dtype, w_dtype, tol",
    [(torch.float64, torch.float64, 1e-12), (torch.float32, torch.bfloat16, 1e-5)],
    ids=["float64", "bf16-weights"],
)


@ROUTE_DTYPES
@pytest.mark.parametrize("sms", [1, 64], ids=["unsplit", "split-K"])
def test_the_cublas_route_applies_the_scale_and_epilogue_the_triton_gemm_does(
    dtype, w_dtype, tol, sms, monkeypatch
):
    """engine.cublas_gemms: cuBLAS's product, then `linear_reduce_kernel`'s scale and
    epilogue, equal the Triton GEMM that fuses them: the fuse gate's row RMS, bias, gated
    epilogue and low copy (its sums in the reduce kernel's column blocks), and the down
    GEMM's two scales over K (the read norm's columns apart) with its gated residual."""
    monkeypatch.setattr(geometry, "sm_count", lambda t: sms)
    a, w, bias, res, fuse, w_next, _ = _operands(dtype, w_dtype, K=40)
    M, K = a.shape
    out = torch.empty(M, K, dtype=dtype)
    widths = {c: gemm.low_sums_width(a, w, cublas=c) for c in (False, True)}
    assert widths[True] == geometry.cdiv(K, gemm.CUBLAS_EPILOGUE_N)
    lows = {}

    def fuse_gate(o, ws):
        cublas = bool(ws.cublas)
        lows[cublas] = (
            torch.empty(M, K, dtype=w_dtype),
            torch.full((M, widths[cublas]), float("nan"), dtype=dtype),  # every block written
        )
        gemm.linear(a, w, o, "t", "fuse-gate GEMM", bias=bias, row_rms=True, eps=1e-6,
                    epilogue=2, res=res, fuse=fuse, low=lows[cublas], workspace=ws,
                    projection="fuse_gate")  # fmt: skip

    got_t, got_c = _both_routes(fuse_gate, out, "fuse_gate")
    torch.testing.assert_close(got_c, got_t, rtol=tol, atol=tol)
    assert torch.equal(lows[True][0], got_c.to(w_dtype))
    torch.testing.assert_close(lows[True][1].sum(1), lows[False][1].sum(1), rtol=tol, atol=0)

    # the down GEMM: read columns [0, 24) scaled by the read norm's sums, the rest by 1
    hidden, k1 = a.to(w_dtype), 24
    sums = torch.rand(M, 3, generator=torch.Generator().manual_seed(2), dtype=dtype) + 0.5
    pg = torch.randn(M, K, generator=torch.Generator().manual_seed(4), dtype=dtype)

    def down(o, ws):
        gemm.linear(hidden, w, o, "t", "down GEMM 0", split=(sums, k1), eps=1e-6, epilogue=1,
                    pg=pg, res=res, workspace=ws, projection="down")  # fmt: skip

    got_t, got_c = _both_routes(down, out)
    torch.testing.assert_close(got_c, got_t, rtol=tol, atol=tol)

    # the input GEMM reading a low copy: every column scaled by its sums (k1 = K)
    def from_low(o, ws):
        gemm.linear(lows[False][0], w_next, o, "t", "input GEMM 0", bias=res[0, :1].expand(72),
                    split=(lows[False][1], K), eps=1e-6, workspace=ws,
                    projection="input")  # fmt: skip

    got_t, got_c = _both_routes(from_low, torch.empty(M, 72, dtype=dtype), "input")
    torch.testing.assert_close(got_c, got_t, rtol=tol, atol=tol)


@ROUTE_DTYPES
@pytest.mark.parametrize("in_consumer", [False, True], ids=["summed", "partials"])
def test_a_plain_product_through_cublas_is_written_whole(dtype, w_dtype, tol, in_consumer):
    """A plain product goes to cuBLAS alone, into `out` (no partials for the consumer to
    sum: it returns None); into a strided view of a wider buffer (tp's row-parallel
    partials) through the reduce kernel, the columns beside it untouched."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(3, 200, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(200, 56, generator=g, dtype=torch.float64) / 200**0.5).to(w_dtype)
    want = (a.to(w_dtype).double() @ w.double()).to(dtype)
    out = torch.full((3, 56), float("nan"), dtype=dtype)
    ws = gemm.SplitWorkspace(out, frozenset({"input_dx"}))
    got = gemm.linear(a, w, out, "t", "input dy W^T", sum_in_consumer=in_consumer,
                      workspace=ws, projection="input_dx")  # fmt: skip
    assert got is None
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)

    wide = torch.full((3, 2 * 56), float("nan"), dtype=dtype)
    gemm.linear(a, w, wide[:, :56], "t", "down GEMM read 0", workspace=ws, projection="input_dx")
    torch.testing.assert_close(wide[:, :56], want, rtol=tol, atol=tol)
    assert wide[:, 56:].isnan().all()


def test_the_cublas_route_is_recorded_as_cublas_launches():
    """The accounting sees cuBLAS's product as a cuBLAS GEMM (`Launch.cublas`, priced at
    the share of the copy bandwidth cuBLAS reaches) and the reduce kernel as ours."""
    from gpn_scale.ops.launch import recording

    a, w, bias, res, fuse, *_ = _operands(torch.float64, torch.float64)
    out = torch.empty_like(a)
    with recording() as launches:
        gemm.linear(a, w, out, "t", "fuse-gate GEMM", bias=bias, row_rms=True, eps=1e-6,
                    epilogue=2, res=res, fuse=fuse, projection="fuse_gate",
                    workspace=gemm.SplitWorkspace(out, frozenset({"fuse_gate"})))  # fmt: skip
    names = [(x.name, x.cublas) for x in launches]
    assert names == [
        ("fuse-gate GEMM (cuBLAS)", True),
        ("fuse-gate GEMM row sums of squares", False),
        ("fuse-gate GEMM (epilogue)", False),
    ]
    assert launches[0].flops == 2 * a.shape[0] * a.shape[1] * w.shape[1]
