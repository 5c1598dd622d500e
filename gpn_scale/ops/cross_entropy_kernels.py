"""The Triton kernel of `cross_entropy.py` (imported only where it is used)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_xent_kernel(
    LOGITS,
    stride_row: tl.int64,
    TARGETS,
    LOSS,
    V,
    NEED_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Grid (rows,): an online log-sum-exp over the row in blocks, then (NEED_GRAD) the row
    overwritten with softmax - onehot."""
    row = tl.program_id(0)
    base = LOGITS + row * stride_row
    tgt = tl.load(TARGETS + row).to(tl.int32)
    m = tl.max(tl.full((BLOCK_V,), float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros((BLOCK_V,), dtype=tl.float32), axis=0)
    for v0 in tl.range(0, V, BLOCK_V, num_stages=STAGES):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    picked = tl.load(base + tgt).to(tl.float32)
    tl.store(LOSS + row, m + tl.log(s) - picked)
    if NEED_GRAD:
        for v0 in tl.range(0, V, BLOCK_V, num_stages=STAGES):
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = cols < V
            x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
            g = tl.exp(x - m) / s - tl.where(cols == tgt, 1.0, 0.0)
            tl.store(base + cols, g.to(LOGITS.dtype.element_ty), mask=ok)
