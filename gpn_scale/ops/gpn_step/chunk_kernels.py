"""Triton kernels of the chunk-wide recompute's fused chains (`fused.py`; imported only where
they are used)."""

from __future__ import annotations

import triton
import triton.language as tl

from gpn_scale.ops.gpn_step.triton_kernels import _rounded, _silu


@triton.jit
def down_input_kernel(
    RG,
    stride_rg: tl.int64,  # (rows, R) the read gate's pre-activations (R = 0: GPN)
    RO,
    stride_ro: tl.int64,  # (rows, R) the normed read
    A,
    stride_a: tl.int64,  # (rows, F) the FFN's gate pre-activations
    B_,
    stride_b: tl.int64,  # (rows, F) the FFN's up values
    OUT,
    stride_out: tl.int64,  # (rows, R + F) in the matmul dtype
    rows,
    R,
    F,
    WIDEN: tl.constexpr,  # the interpreter's bf16 store (see `triton_kernels._rounded`)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """OUT = [silu(RG) * RO, silu(A) * B], computed in float32, stored in OUT's dtype."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = (rm < rows)[:, None]
    read = (rn < R)[None, :] & m_ok
    ffn = ((rn >= R) & (rn < R + F))[None, :] & m_ok
    rows_ = rm[:, None]
    # Each column's gate and value come from one of the two parts (masked loads, merged
    # before the arithmetic: one silu per element).
    x = tl.where(
        read,
        tl.load(RG + rows_ * stride_rg + rn[None, :], mask=read, other=0.0),
        tl.load(A + rows_ * stride_a + (rn - R)[None, :], mask=ffn, other=0.0),
    )
    y = tl.where(
        read,
        tl.load(RO + rows_ * stride_ro + rn[None, :], mask=read, other=0.0),
        tl.load(B_ + rows_ * stride_b + (rn - R)[None, :], mask=ffn, other=0.0),
    )
    value = _silu(x) * y
    tl.store(OUT + rows_ * stride_out + rn[None, :], _rounded(value, WIDEN), mask=read | ffn)


@triton.jit
def rms_rows_kernel(
    X,
    stride_x0: tl.int64,
    stride_x1: tl.int64,  # (R1, R2, n) rows, unit column stride
    R2,
    OUT,  # (R1 * R2, n) the normed rows
    LOW,  # HAS_LOW: the same in the matmul dtype (times WEIGHT where HAS_WEIGHT)
    COPY,  # HAS_COPY: the rows themselves
    WEIGHT,  # HAS_WEIGHT: (n,) the norm's weight, applied to LOW only
    SCALE,  # HAS_SCALE: (R1 * R2,) each row's rsqrt(mean(x^2) + eps)
    n,
    eps,
    HAS_LOW: tl.constexpr,
    HAS_COPY: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    WIDEN: tl.constexpr,  # the interpreter's bf16 store (see `triton_kernels._rounded`)
    BLOCK: tl.constexpr,
):
    """Grid (R1 * R2,): one row's sum of squares over its columns in blocks, then the row
    scaled (the second pass reads it back from cache) and stored to each output."""
    row = tl.program_id(0)
    src = X + (row // R2) * stride_x0 + (row % R2) * stride_x1
    dst = row.to(tl.int64) * n
    acc = tl.zeros((BLOCK,), dtype=OUT.dtype.element_ty)
    for c0 in range(0, n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        x = tl.load(src + cols, mask=cols < n, other=0.0)
        acc += x * x
    r = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n + eps)
    if HAS_SCALE:
        tl.store(SCALE + row, r)
    for c0 in range(0, n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < n
        x = tl.load(src + cols, mask=ok, other=0.0)
        y = x * r
        tl.store(OUT + dst + cols, y, mask=ok)
        if HAS_LOW:
            if HAS_WEIGHT:
                y = y * tl.load(WEIGHT + cols, mask=ok, other=0.0)
            tl.store(LOW + dst + cols, _rounded(y, WIDEN), mask=ok)
        if HAS_COPY:
            tl.store(COPY + dst + cols, x, mask=ok)


@triton.jit
def l2n_relu_rows_kernel(
    X,
    stride_x: tl.int64,  # (rows, H * DK) pre-activations, unit column stride
    OUT,  # (rows, H, DK) compact
    H,
    DK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_DK: tl.constexpr,
):
    """Grid (rows,): every head of one row, l2n(relu(x)) per head of DK values."""
    row = tl.program_id(0)
    rh = tl.arange(0, BLOCK_H)[:, None]
    rk = tl.arange(0, BLOCK_DK)[None, :]
    ok = (rh < H) & (rk < DK)
    pre = tl.load(X + row * stride_x + rh * DK + rk, mask=ok, other=0.0)
    x = tl.maximum(pre, 0.0)
    y = x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-12)[:, None]
    tl.store(OUT + row.to(tl.int64) * H * DK + rh * DK + rk, y, mask=ok)


@triton.jit
def cast_column_sums_kernel(
    X,
    stride_x: tl.int64,  # (rows, N) float32, unit column stride
    LOW,
    stride_low: tl.int64,  # (rows, N) in the matmul dtype
    PARTS,  # (row groups, N) float32: each group's column sums
    rows,
    N,
    GROUP_ROWS,
    WIDEN: tl.constexpr,  # the interpreter's bf16 store (see `triton_kernels._rounded`)
    STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (column blocks, row groups): each program walks its group's rows of its columns,
    storing them in LOW's dtype and summing them into its own PARTS entries (no atomics:
    the caller sums the groups in a fixed order)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=PARTS.dtype.element_ty)
    first = group * GROUP_ROWS
    end = tl.minimum(first + GROUP_ROWS, rows)
    for m0 in tl.range(first, end, BLOCK_M, num_stages=STAGES):
        rm = m0 + tl.arange(0, BLOCK_M)
        ok = (rm < end)[:, None] & n_ok[None, :]
        r = rm[:, None].to(tl.int64)
        x = tl.load(X + r * stride_x + rn[None, :], mask=ok, other=0.0)
        tl.store(LOW + r * stride_low + rn[None, :], _rounded(x, WIDEN), mask=ok)
        acc += x
    tl.store(PARTS + group.to(tl.int64) * N + rn, tl.sum(acc, axis=0), mask=n_ok)


@triton.jit
def rms_back_rows_kernel(
    DY,  # (rows, n) the gradient at the weighted norm's output
    N_,  # (rows, n) the normed rows
    SCALE,  # (rows,) their rsqrt(mean(x^2) + eps)
    WEIGHT,  # (n,) the norm's weight
    DX,  # (rows, n) the gradient at the rows
    stride_dx: tl.int64,
    n,
    BLOCK: tl.constexpr,
):
    """Grid (rows,): dx = r (dn - n mean(dn n)) with dn = dy * weight, a row a program (the
    second pass reads the row back from cache)."""
    row = tl.program_id(0)
    src = row.to(tl.int64) * n
    acc = tl.zeros((BLOCK,), dtype=DX.dtype.element_ty)
    for c0 in range(0, n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < n
        dn = tl.load(DY + src + cols, mask=ok, other=0.0) * tl.load(
            WEIGHT + cols, mask=ok, other=0.0
        )
        acc += dn * tl.load(N_ + src + cols, mask=ok, other=0.0)
    mean = tl.sum(acc, axis=0) / n
    r = tl.load(SCALE + row)
    for c0 in range(0, n, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < n
        dn = tl.load(DY + src + cols, mask=ok, other=0.0) * tl.load(
            WEIGHT + cols, mask=ok, other=0.0
        )
        x = tl.load(N_ + src + cols, mask=ok, other=0.0)
        tl.store(DX + row.to(tl.int64) * stride_dx + cols, r * (dn - x * mean), mask=ok)
