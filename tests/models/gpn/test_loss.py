"""The chunked decode + cross-entropy (gpn_scale/models/gpn/loss.py): equal to the slow form,
whole or fed in the engine's pieces, no backward work under torch.no_grad(), no host sync in
its backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gpn_scale.models.gpn.loss import (
    ChunkFeed,
    DecodePass,
    chunked_decode_cross_entropy,
    decode_cross_entropy,
)
from gpn_scale.ops.gpn_step import overlap

N, D, E_DIM, V, ROWS = 40, 16, 12, 50, 16  # 3 row blocks, the last one partial
BLOCKS = -(-N // ROWS)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return self.ops.count(name)


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    P = torch.randn(N, D, generator=g, dtype=dtype, requires_grad=True)
    norm_w = (1 + 0.1 * torch.randn(D, generator=g, dtype=dtype)).requires_grad_()
    W = (0.3 * torch.randn(E_DIM, D, generator=g, dtype=dtype)).requires_grad_()
    b = (0.1 * torch.randn(E_DIM, generator=g, dtype=dtype)).requires_grad_()
    E = (0.3 * torch.randn(V, E_DIM, generator=g, dtype=dtype)).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    return (P, norm_w, W, b, E), y


def _loss(params, y, scale=1.0):
    return chunked_decode_cross_entropy(*params, y, rows=ROWS, scale=scale)


def test_equals_the_full_logits_cross_entropy():
    params, y = _inputs()
    P, norm_w, W, b, E = params
    got = _loss(params, y, scale=0.5)
    g_got = torch.autograd.grad(got, params)
    n = P * torch.rsqrt(P.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
    want = 0.5 * F.cross_entropy((n @ W.t() + b) @ E.t(), y, reduction="sum")
    g_want = torch.autograd.grad(want, params)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    for name, a, w in zip(("P", "norm_w", "W_dec", "b_dec", "E"), g_got, g_want):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-12, msg=name)


def test_no_grad_does_no_backward_work():
    """Held-out eval runs under no_grad with parameters that require grad: only the two
    forward matmuls per row block, no (N x d) gradient buffer, nothing saved."""
    params, y = _inputs()
    with _CountOps() as with_grad:
        want = _loss(params, y)
    with torch.no_grad(), _CountOps() as no_grad:
        got = _loss(params, y)
    assert no_grad.count("mm") == 2 * BLOCKS
    assert with_grad.count("mm") == 6 * BLOCKS  # + dh, dE, dW, d(normed input)
    assert not any(op.startswith("empty") for op in no_grad.ops), no_grad.ops
    assert got.grad_fn is None and torch.equal(got, want.detach())


@pytest.mark.parametrize("upstream", [1.0, 0.25])
def test_backward_makes_no_host_sync_and_scales_exactly(upstream):
    """No .item() (aten._local_scalar_dense: a device sync on GPU) in the backward; the
    upstream gradient is applied on the device, exactly (1.0 leaves dL/dP bit for bit)."""
    params, y = _inputs(torch.float32)
    ref = torch.autograd.grad(_loss(params, y), params)  # upstream exactly 1
    loss = _loss(params, y) * upstream
    with _CountOps() as ops:
        got = torch.autograd.grad(loss, params)
    assert ops.count("_local_scalar_dense") == 0
    for a, r in zip(got, ref):  # scaling by a power of two is exact in binary floating point
        assert torch.equal(a, r * upstream)


# ------------------------------------------------------- fed in pieces (the engine's form)
def test_fed_in_pieces_equals_the_full_logits_cross_entropy():
    """The engine's form: `ChunkFeed` feeds a `DecodePass` the (B, T, d) states stretch by
    stretch as the sequence op makes them; loss and every gradient (dL/dP in P's shape) equal
    the slow form over the same positions."""
    B, T, chunk, rows = 2, 20, 3, 7
    params, y = _inputs()
    P = params[0].detach()[: B * T].reshape(B, T, D).requires_grad_()
    norm_w, W, b, E = params[1:]
    targets = y[: B * T].reshape(B, T)
    decode = DecodePass(norm_w, W, b, E, rows, 1e-6, None, True, None, P.dtype)
    feed = ChunkFeed(decode, targets, overlap.Inline())
    fed: list[int] = []  # where each piece ends
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        before = len(feed.pieces)
        feed(P.detach(), start, end)
        if len(feed.pieces) > before:
            fed.append(end)
    got = decode_cross_entropy(P, norm_w, W, b, E, feed.finish, scale=0.25)
    # every piece is >= rows positions tall but the last: 6 steps (12 rows) each, then 2
    assert fed == [6, 12, 18, 20]
    n = P * torch.rsqrt(P.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w
    logits = (n @ W.t() + b) @ E.t()
    want = 0.25 * F.cross_entropy(logits.reshape(B * T, V), targets.reshape(-1), reduction="sum")
    inputs = (P, norm_w, W, b, E)
    for name, a, w in zip(
        ("P", "norm_w", "W_dec", "b_dec", "E"),
        torch.autograd.grad(got, inputs),
        torch.autograd.grad(want, inputs),
    ):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("batch", "steps", "chunk", "rows", "ends"),
    [
        (2, 20, 3, 7, [6, 12, 18, 20]),  # two chunks make a piece
        (4, 12, 4, 16, [4, 8, 12]),  # a chunk is a piece
        (1, 10, 4, 1024, [10]),  # one sequence of a few steps: one piece
    ],
)
def test_pieces_are_rows_tall_but_the_last(batch, steps, chunk, rows, ends):
    first, got = 0, []
    for end in [*range(chunk, steps, chunk), steps]:
        if ChunkFeed.ends_piece(batch, first, end, steps, rows):
            got.append(end)
            first = end
    assert got == ends
