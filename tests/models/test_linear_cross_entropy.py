"""The baselines' head loss a block of positions at a time (gpn_scale/models/
linear_cross_entropy.py): the full-logits cross-entropy's loss and gradients, without ever
holding the (B*T x V) logits. (GPN's decode loss, which shares its block: tests/models/gpn/
test_loss.py; the vocabulary-parallel block: tests/parallel/test_vocab_parallel.py. The
baselines' heads are replicated under tensor parallelism, so theirs has no tp form.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gpn_scale.models.linear_cross_entropy import linear_cross_entropy
from gpn_scale.models.registry import load_model_config

FAMILIES = [
    ("transformer_pp_tiny", {}),
    ("transformer_pp_tiny", {"tie_embeddings": True}),  # the head is a slice of the embedding
    ("gated_deltanet_tiny", {}),
]
ROWS = 7  # divides neither 2 x 19 nor 4 x 64 positions: a short last block


def _model(name: str, changes: dict, dtype: torch.dtype = torch.float64, rows: int = ROWS):
    spec, cfg = load_model_config(name, {**changes, "loss_chunk_tokens": rows})
    torch.manual_seed(0)
    return cfg, spec.build(cfg).to(dtype)


@pytest.mark.parametrize(("name", "changes"), FAMILIES, ids=["tpp", "tpp-tied", "gdn"])
def test_the_chunked_loss_and_gradients_are_the_full_logits_ones_in_float64(name, changes):
    cfg, model = _model(name, changes)
    tokens = torch.randint(0, cfg.vocab_size, (2, 19))
    out = model(tokens, return_logits=True)
    full = F.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), tokens.reshape(-1))
    torch.testing.assert_close(out.loss, full, rtol=1e-12, atol=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(out.loss, params, retain_graph=True)
    want = torch.autograd.grad(full, params)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for n, g, w in zip(names, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13, msg=n)
    with torch.no_grad():  # held-out eval: no gradients formed, the same loss
        assert model(tokens).loss.item() == pytest.approx(full.item(), rel=1e-12)


def test_the_op_alone_in_float32_and_under_bf16_autocast():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(53, 24, generator=g, requires_grad=True)
    W = (0.3 * torch.randn(97, 24, generator=g)).requires_grad_()
    y = torch.randint(0, 97, (53,), generator=g)
    loss = linear_cross_entropy(h, W, y, rows=10)
    full = F.cross_entropy(h @ W.t(), y)
    torch.testing.assert_close(loss, full)  # float32's defaults: rtol 1.3e-6
    for got, want in zip(torch.autograd.grad(loss, (h, W)), torch.autograd.grad(full, (h, W))):
        torch.testing.assert_close(got, want)
    # Under autocast the block matmuls run in bf16, as the head's nn.Linear would; the
    # softmax and the sums stay float32 (the loss and the gradients' dtypes are the inputs').
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, W, y, rows=10)
        full = F.cross_entropy(F.linear(h, W).float(), y)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, full, rtol=2e-3, atol=0.0)
    dh, dW = torch.autograd.grad(loss, (h, W))
    assert dh.dtype == dW.dtype == torch.float32
    with pytest.raises(ValueError, match="rows: must be >= 1"):
        linear_cross_entropy(h, W, y, rows=0)


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize(("name", "changes"), FAMILIES[::2], ids=["tpp", "gdn"])
def test_a_training_step_never_holds_the_logits(name, changes):
    """4 x 64 positions x V = 512 is 131,072 logits: more than any other tensor of the tiny
    models (the embedding 513 x 64, the FFN's 256 x 192, the attention's 4 x 4 x 64 x 64)."""
    cfg, model = _model(name, changes, torch.float32, rows=16)
    tokens = torch.randint(0, cfg.vocab_size, (4, 64))
    logits = tokens.numel() * cfg.vocab_size
    with _LargestTensor() as probe:
        model(tokens).loss.backward()
    assert 16 * cfg.vocab_size <= probe.largest < logits
    with _LargestTensor() as probe:  # the probe sees logits where they are made
        model(tokens, return_logits=True)
    assert probe.largest == logits
