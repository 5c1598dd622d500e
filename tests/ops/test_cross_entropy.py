"""The fused softmax cross-entropy kernel (gpn_scale/ops/cross_entropy.py, Triton, run by the
interpreter on CPU tensors here) equals the PyTorch form it replaces on CUDA, alone and
inside the chunked decode loss (loss and every gradient)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpn_scale.models.gpn.loss import chunked_decode_cross_entropy
from gpn_scale.ops.backends import Request
from gpn_scale.ops.cross_entropy import BACKENDS, softmax_xent_, use_triton
from gpn_scale.ops.execution import execution

# Every registered form in float32; the reference also in float64 (`select` keeps float64
# logits off the kernel, which computes in float32).
FORMS = [(b.name, torch.float32) for b in BACKENDS.backends] + [("torch", torch.float64)]


@pytest.mark.parametrize("backend,acc", FORMS)
def test_every_backend_equals_torch_functional(backend, acc):
    """Each registered form, as the decode calls it: the block's summed loss and
    softmax - onehot in the logits' dtype."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 19, generator=g, dtype=acc) * 3
    targets = torch.randint(0, 19, (6,), generator=g)
    want = F.cross_entropy(logits, targets, reduction="sum")
    want_grad = torch.softmax(logits, -1) - F.one_hot(targets, 19).to(acc)
    form = BACKENDS.get(backend).implementation(Request("cuda"))
    with execution(triton_anywhere=True):
        total, grad = form(logits.clone(), targets, True, acc)
        only, none = form(logits.clone(), targets, False, acc)
    tol = 1e-12 if backend == "torch" and acc == torch.float64 else 1e-5
    torch.testing.assert_close(total, want, rtol=tol, atol=tol)
    torch.testing.assert_close(only, want, rtol=tol, atol=tol)
    torch.testing.assert_close(grad, want_grad, rtol=tol, atol=tol)
    assert none is None and grad.dtype == acc


@pytest.mark.parametrize("V", [7, 16, 50])
def test_rows_loss_and_gradient_equal_torch(V):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g) * 3
    targets = torch.randint(0, V, (5,), generator=g)
    want = F.cross_entropy(logits, targets, reduction="none")
    want_grad = torch.softmax(logits, -1) - F.one_hot(targets, V).float()
    with execution(triton_anywhere=True):
        assert use_triton(logits)
        work = logits.clone()
        got = softmax_xent_(work, targets, need_grad=True)
        only = softmax_xent_(logits.clone(), targets, need_grad=False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(only, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(work, want_grad, rtol=1e-6, atol=1e-7)


def test_cpu_and_float64_keep_the_pytorch_form():
    assert not use_triton(torch.zeros(2, 3))
    with execution(triton_anywhere=True):
        assert not use_triton(torch.zeros(2, 3, dtype=torch.float64))


def test_decode_loss_with_the_kernel_equals_the_pytorch_form():
    g = torch.Generator().manual_seed(1)
    N, D, E_DIM, V = 40, 16, 12, 50
    P = torch.randn(N, D, generator=g, requires_grad=True)
    norm_w = (1 + 0.1 * torch.randn(D, generator=g)).requires_grad_()
    W = (0.3 * torch.randn(E_DIM, D, generator=g)).requires_grad_()
    E = (0.3 * torch.randn(V, E_DIM, generator=g)).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    inputs = (P, norm_w, W, E)

    def run():
        loss = chunked_decode_cross_entropy(P, norm_w, W, None, E, y, rows=16, scale=1 / N)
        return loss, torch.autograd.grad(loss, inputs)

    want, g_want = run()
    with execution(triton_anywhere=True):
        got, g_got = run()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
