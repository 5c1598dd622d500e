"""The same accounting for what users would otherwise train: a Transformer++ step.

    python -m gpn_scale.accounting.gpu_model gpn_m_130m --batch 64     # prints both side by side

The family's own model (`models/transformer_pp`) runs one training step (forward, loss,
backward) on meta tensors in bf16, eager PyTorch as the device check trains it, and every
ATen op that launches a kernel is recorded with its operands' bytes and matmul FLOPs (the
dispatch recorder of `gpu_model.py`). Attention is what a GPU runs for
`F.scaled_dot_product_attention` in bf16, flash attention, not the math form meta tensors
would decompose it into: within the dry run a stand-in records one forward and one backward
kernel per layer with flash attention's FLOPs (causal: half the T x T scores) and its
bytes (q, k, v, o, the row statistics; the backward also dO, dq, dk, dv), priced at
`EFF_ATTENTION` of the dense peak. Each op is then priced like the GPN's chunk-wide ATen
work: max(bytes / bandwidth, FLOPs / peak) plus the gap between kernels, at least the
host's launch cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from gpn_scale.accounting.kernel_record import AtenRecorder, Op

# FlashAttention-2 (what torch's SDPA runs in bf16 on H100/H200) reaches ~35-40% of the
# dense bf16 peak for causal attention at head dim 64-128, forward and backward alike
# (FlashAttention-2 and -3 papers' H100 figures); FlashAttention-3 ~60%.
EFF_ATTENTION = 0.35


class _Recorded:
    ops: list | None = None


class _FlashAttentionStandIn(torch.autograd.Function):
    """Records flash attention's forward and backward kernels; returns empty tensors."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        B, H, T, dh = q.shape
        flops = 2 * 2 * B * H * T * T * dh // 2  # QK^T and PV, causal half
        lse = B * H * T * 4
        _record("flash attention forward", 4 * q.numel() * q.element_size() + lse, flops)
        ctx.meta = (q.shape, q.dtype, q.device, flops, lse, q.numel() * q.element_size())
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout: Tensor):
        shape, dtype, device, flops, lse, size = ctx.meta
        # q, k, v, o, dO read, dq, dk, dv written; 2.5x the forward's FLOPs (the scores are
        # recomputed, then dV, dP, dS, dQ, dK).
        _record("flash attention backward", 8 * size + lse, int(2.5 * flops))
        return tuple(torch.empty(shape, dtype=dtype, device=device) for _ in range(3))


def _record(name: str, nbytes: int, flops: int) -> None:
    # into the dispatch recorder's list, in the order the step runs them
    if _Recorded.ops is not None:
        _Recorded.ops.append(Op(name, "attention", nbytes, flops, False, efficiency=EFF_ATTENTION))


@contextlib.contextmanager
def _flash_attention(ops: list) -> Iterator[None]:
    real = F.scaled_dot_product_attention

    def stand_in(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        assert is_causal and attn_mask is None, "the training step's attention is causal"
        return _FlashAttentionStandIn.apply(q, k, v)

    _Recorded.ops = ops
    setattr(F, "scaled_dot_product_attention", stand_in)  # noqa: B010  (mypy: not its type)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real
        _Recorded.ops = None


_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


def fused(ops: list[Op]) -> list[Op]:
    """The step as `torch.compile` runs it (compile.enable): the matmuls and flash attention
    as they are, and each run of pointwise and reduction ops between two of them as ONE
    kernel (inductor fuses them), which moves at least the largest operand set of the run
    once: that op's bytes. A lower bound on what inductor's kernels move; the matmuls and
    attention are the eager step's own."""
    out: list[Op] = []
    run: list[Op] = []

    def flush() -> None:
        if run:
            big = max(run, key=lambda op: op.bytes)
            out.append(Op(f"fused pointwise ({len(run)} ops)", big.phase, big.bytes, 0, False))
            run.clear()

    for op in ops:
        if op.name.rstrip("_") in _MATMULS or op.phase == "attention":
            flush()
            out.append(op)
        else:
            run.append(op)
    flush()
    return out


def transformer_step_ops(cfg, batch: int, seq_len: int, compiled: bool = False) -> list:
    """Every kernel of one Transformer++ training step (bf16) at (batch, seq_len); with
    `compiled`, its pointwise runs fused as torch.compile fuses them (`fused`)."""
    from gpn_scale.models.registry import family_of

    spec = family_of(cfg)
    with torch.device("meta"):
        model = spec.build(cfg).to(torch.bfloat16)
    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    recorder = AtenRecorder(sequential=True)
    with _flash_attention(recorder.ops), recorder:
        model(tokens).loss.backward()
    ops = recorder.ops
    return fused(ops) if compiled else ops
