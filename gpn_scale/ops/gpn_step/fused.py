"""The chunk-wide work's elementwise chains fused: in the backward's recompute the RMS norms
(with the copy in the matmul dtype their GEMM and weight gradient read), the keys' and
queries' l2n(relu) and the down projection's input, [silu(rg) * ro, silu(a) * b] (GPN: the
FFN part alone); the weight gradients' adjoint cast with its bias sums; the decode's
weighted norm and its backward.

As PyTorch ops each chain is several passes over float32 rows: a norm is a power, a mean,
a product and a cast; the down input two silu, two products, a concatenation and a cast, and
the weight gradients cast the kept float32 copies once more (~3 GB a chunk at 130M and
B = 128, the accounting's "parallel recompute"); the decode's norm and its backward are
~15 launches a block of rows. Each kernel reads its operands once and writes each result
once. Two forms behind one choice (`backends.torch_or_triton`): PyTorch (the reference, and
the path on CPU and in float64) and Triton (`chunk_kernels.py`; CUDA, and the dry launch
accounting on meta tensors). GPN_SCALE_CHUNK_FUSION=torch keeps the PyTorch forms
everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from gpn_scale.ops.backends import select_torch_or_triton, torch_or_triton
from gpn_scale.ops.gpn_step.functional import l2n
from gpn_scale.ops.gpn_step.functional import rms as _plain_rms
from gpn_scale.ops.gpn_step.geometry import cdiv, interpreting, p2
from gpn_scale.ops.gpn_step.phases import current_phase
from gpn_scale.ops.launch import launch, nbytes

ENV_VAR = "GPN_SCALE_CHUNK_FUSION"
# The down input: rows x columns a program, and its warps (on a GPU; the interpreter's are
# 2 x 16, one warp).
DOWN_INPUT_BLOCK = (2, 1024)
DOWN_INPUT_WARPS = 4
# The norm: a row a program, its columns in blocks of at most this many.
NORM_BLOCK = 4096
# The weight gradients' adjoint cast: rows x columns a tile, pipelined over the rows.
CAST_BLOCK = (16, 128)
CAST_GROUP_ROWS = 256
CAST_STAGES = 3
CAST_WARPS = 4
NORM_WARPS = 4  # (8 spill some variants: the compiler caps them at 32 registers)


class FusedBackendError(RuntimeError):
    """A form of the recompute's fused chains was asked for that cannot serve here."""


@dataclass(frozen=True)
class Forms:
    """One form of every chain (`TORCH`, `TRITON`)."""

    rms: Callable[..., Tensor]
    down_input: Callable[[Tensor | None, Tensor | None, Tensor, Tensor, torch.dtype], Tensor]
    l2n_relu: Callable[[Tensor, Tensor], Tensor]
    cast_with_sums: Callable[[Tensor, Tensor, Tensor], Tensor]
    rms_back: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
    weighted_rms: Callable[..., tuple[Tensor, Tensor, Tensor]]
    gated_residual: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


# ----------------------------------------------------------------------- PyTorch forms
def torch_rms(
    x: Tensor, eps: float, out: Tensor, low: Tensor | None = None, copy: Tensor | None = None
) -> Tensor:
    """out = x * rsqrt(mean(x^2) + eps) over the last dim (x: (..., n), any strides; out
    compact); `low`: out again in its dtype (the matmul's); `copy`: x itself, compact."""
    if copy is not None:
        x = copy.copy_(x)
    _plain_rms(x, eps, out)
    if low is not None:
        low.copy_(out)
    return out


def torch_weighted_rms(
    x: Tensor, eps: float, weight: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """(n = rms(x), n * weight in `dtype`, each row's rsqrt(mean(x^2) + eps)) of rows x
    (rows, width)."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    n = x * r
    return n, (n * weight).to(dtype), r.squeeze(-1)


def torch_gated_residual(pg: Tensor, res: Tensor, x: Tensor, out: Tensor) -> Tensor:
    """out = sigmoid(pg) * res + x (the layer's output: the gated state plus the down
    projection's)."""
    return torch.add(torch.sigmoid(pg) * res, x, out=out)


def torch_rms_back(dy: Tensor, n: Tensor, scale: Tensor, weight: Tensor, dx: Tensor) -> Tensor:
    """dx = r (dn - n mean(dn n)) with dn = dy * weight: the gradient at x of
    rms(x) * weight, given the normed rows n and their scales r (rows,)."""
    dn = dy * weight
    dx.copy_(scale[:, None] * (dn - n * (dn * n).mean(-1, keepdim=True)))
    return dx


def torch_down_input(
    rg: Tensor | None, ro: Tensor | None, a: Tensor, b: Tensor, dtype: torch.dtype
) -> Tensor:
    """In the operands' dtype, cast once at the end."""
    hidden = F.silu(a) * b
    if rg is not None and ro is not None:
        hidden = torch.cat([F.silu(rg) * ro, hidden], dim=-1)
    return hidden.to(dtype)


def torch_l2n_relu(pre: Tensor, out: Tensor) -> Tensor:
    """out (..., H, dk) = l2n(relu(pre)) per head of pre (..., H * dk)."""
    return l2n(F.relu(pre).view(out.shape), out)


def torch_cast_with_sums(x: Tensor, low: Tensor, sums: Tensor) -> Tensor:
    """low = x in low's dtype (the weight gradient's GEMM operand); sums += x's column sums
    (its bias gradient)."""
    sums += x.sum(0)
    return low.copy_(x)


# ----------------------------------------------------------------------- Triton forms
def _rows(t: Tensor) -> Tensor:
    """(..., n) as (rows, n): a view for the recompute's operands (y's columns, buffers)."""
    return t.reshape(-1, t.shape[-1])


def _row_meta(t: Tensor, width: int, block: str = "BLOCK") -> dict:
    """A row-a-program kernel's block (columns at a time: its meta-parameter `block`) and
    warps."""
    if interpreting(t):
        return {block: 16, "num_warps": 1}
    return {block: min(NORM_BLOCK, p2(width)), "num_warps": NORM_WARPS}


def _phase() -> str:
    return current_phase() or "outside the loop"


def triton_rms(
    x: Tensor,
    eps: float,
    out: Tensor,
    low: Tensor | None = None,
    copy: Tensor | None = None,
    weight: Tensor | None = None,
    scale: Tensor | None = None,
) -> Tensor:
    """One kernel: a row a program, float32 (or x's) sums, each result stored once."""
    from gpn_scale.ops.gpn_step import chunk_kernels as k

    x3 = x if x.dim() == 3 else x[None]
    assert out.is_contiguous() and x3.dim() == 3 and x.stride(-1) == 1, "rows, compact results"
    R1, R2, n = x3.shape
    placeholder = out
    launch(
        k.rms_rows_kernel,
        (R1 * R2,),
        "rms norm",
        _phase(),
        nbytes(x, out, low, copy, weight, scale),
        3 * x.numel(),
        x3,
        x3.stride(0),
        x3.stride(1),
        R2,
        out,
        low if low is not None else placeholder,
        copy if copy is not None else placeholder,
        weight if weight is not None else placeholder,
        scale if scale is not None else placeholder,
        n,
        eps,
        HAS_LOW=low is not None,
        HAS_COPY=copy is not None,
        HAS_WEIGHT=weight is not None,
        HAS_SCALE=scale is not None,
        WIDEN=interpreting(x) and low is not None and low.dtype == torch.bfloat16,
        **_row_meta(x, n),
    )
    return out


def triton_weighted_rms(
    x: Tensor, eps: float, weight: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """`triton_rms` with the weight and the rows' scales."""
    n = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    nw = torch.empty(x.shape, dtype=dtype, device=x.device)
    r = x.new_empty(x.shape[0])
    triton_rms(x, eps, n, nw, weight=weight, scale=r)
    return n, nw, r


def triton_gated_residual(pg: Tensor, res: Tensor, x: Tensor, out: Tensor) -> Tensor:
    """The step backend's gated residual kernel (`triton_kernels.gated_residual_kernel`,
    without its read norm) over the chunk's rows."""
    from gpn_scale.ops.gpn_step import triton_kernels as tk

    pg2, res2, x2, out2 = _rows(pg), _rows(res), _rows(x), _rows(out)
    width = out2.shape[1]
    launch(
        tk.gated_residual_kernel,
        (out2.shape[0],),
        "gated residual",
        _phase(),
        nbytes(pg2, res2, x2, out2),
        4 * out2.numel(),
        x2,
        x2.stride(0),
        pg2,
        pg2.stride(0),
        res2,
        res2.stride(0),
        out2,
        out2.stride(0),
        out2,
        width,
        0.0,
        SS_WIDTH=1,
        N_SS=1,
        SS_COLS=1,
        NORM=False,
        **_row_meta(out, width, "BLOCK_D"),
    )
    return out


def triton_rms_back(dy: Tensor, n: Tensor, scale: Tensor, weight: Tensor, dx: Tensor) -> Tensor:
    """One kernel: a row a program."""
    from gpn_scale.ops.gpn_step import chunk_kernels as k

    assert dy.is_contiguous() and n.is_contiguous() and dx.stride(-1) == 1
    rows, width = n.shape
    launch(
        k.rms_back_rows_kernel,
        (rows,),
        "norm backward",
        _phase(),
        nbytes(dy, n, scale, weight, dx),
        6 * n.numel(),
        dy,
        n,
        scale,
        weight,
        dx,
        dx.stride(0),
        width,
        **_row_meta(n, width),
    )
    return dx


def triton_down_input(
    rg: Tensor | None, ro: Tensor | None, a: Tensor, b: Tensor, dtype: torch.dtype
) -> Tensor:
    """One kernel: float32 products, one store in `dtype`."""
    from gpn_scale.ops.gpn_step import chunk_kernels as k

    lead, F_ = a.shape[:-1], a.shape[-1]
    R = 0 if rg is None else rg.shape[-1]
    a2, b2 = _rows(a), _rows(b)
    rg2 = a2 if rg is None else _rows(rg)
    ro2 = a2 if ro is None else _rows(ro)
    rows = a2.shape[0]
    out = torch.empty((rows, R + F_), dtype=dtype, device=a.device)
    tiny = interpreting(a)
    block_m, block_n = (2, 16) if tiny else DOWN_INPUT_BLOCK
    launch(
        k.down_input_kernel,
        (cdiv(rows, block_m), cdiv(R + F_, block_n)),
        "down input",
        _phase(),
        nbytes(a2, b2, out) + (2 * nbytes(rg2) if rg is not None else 0),
        4 * rows * (R + F_),
        rg2,
        rg2.stride(0),
        ro2,
        ro2.stride(0),
        a2,
        a2.stride(0),
        b2,
        b2.stride(0),
        out,
        out.stride(0),
        rows,
        R,
        F_,
        WIDEN=tiny and dtype == torch.bfloat16,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=1 if tiny else DOWN_INPUT_WARPS,
    )
    return out.view(*lead, R + F_)


def triton_l2n_relu(pre: Tensor, out: Tensor) -> Tensor:
    """One kernel: a row's heads a program."""
    from gpn_scale.ops.gpn_step import chunk_kernels as k

    assert out.is_contiguous()
    H, dk = out.shape[-2:]
    pre2 = _rows(pre)
    launch(
        k.l2n_relu_rows_kernel,
        (pre2.shape[0],),
        "recompute l2n",
        _phase(),
        nbytes(pre2, out),
        4 * out.numel(),
        pre2,
        pre2.stride(0),
        out,
        H,
        DK=dk,
        BLOCK_H=p2(H),
        BLOCK_DK=p2(dk),
        num_warps=1 if interpreting(pre) else 4,
    )
    return out


def triton_cast_with_sums(x: Tensor, low: Tensor, sums: Tensor) -> Tensor:
    """One pass over x: a program per (column block, group of rows) stores its tile in
    low's dtype and sums its columns; the groups' sums are added in a fixed order."""
    from gpn_scale.ops.gpn_step import chunk_kernels as k

    rows, N = x.shape
    tiny = interpreting(x)
    block_m, block_n = (4, 16) if tiny else CAST_BLOCK
    group_rows = 8 if tiny else CAST_GROUP_ROWS
    parts = x.new_empty((cdiv(rows, group_rows), N))
    launch(
        k.cast_column_sums_kernel,
        (cdiv(N, block_n), parts.shape[0]),
        "adjoint cast and sums",
        _phase(),
        nbytes(x, low, parts),
        x.numel(),
        x,
        x.stride(0),
        low,
        low.stride(0),
        parts,
        rows,
        N,
        group_rows,
        WIDEN=tiny and low.dtype == torch.bfloat16,
        STAGES=1 if tiny else CAST_STAGES,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=1 if tiny else CAST_WARPS,
    )
    sums += parts.sum(0)
    return low


TORCH = Forms(
    torch_rms,
    torch_down_input,
    torch_l2n_relu,
    torch_cast_with_sums,
    torch_rms_back,
    torch_weighted_rms,
    torch_gated_residual,
)
TRITON = Forms(
    triton_rms,
    triton_down_input,
    triton_l2n_relu,
    triton_cast_with_sums,
    triton_rms_back,
    triton_weighted_rms,
    triton_gated_residual,
)
BACKENDS = torch_or_triton(
    "chunk fusion", ENV_VAR, FusedBackendError, TORCH, TRITON, "one kernel a chain"
)


def select(like: Tensor) -> Forms:
    """The forms for operands like `like` (`backends.select_torch_or_triton`)."""
    return select_torch_or_triton(BACKENDS, like, TORCH)


def rms(
    x: Tensor, eps: float, out: Tensor, low: Tensor | None = None, copy: Tensor | None = None
) -> Tensor:
    """RMSNorm of x's rows into `out` (with `low`, `copy`: see `torch_rms`), by `select`."""
    return select(x).rms(x, eps, out, low, copy)


def weighted_rms(
    x: Tensor, eps: float, weight: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """(rms(x), rms(x) * weight in `dtype`, the rows' scales) (`torch_weighted_rms`), by
    `select`."""
    return select(x).weighted_rms(x, eps, weight, dtype)


def gated_residual(pg: Tensor, res: Tensor, x: Tensor, out: Tensor) -> Tensor:
    """out = sigmoid(pg) * res + x, by `select`."""
    return select(x).gated_residual(pg, res, x, out)


def rms_back(dy: Tensor, n: Tensor, scale: Tensor, weight: Tensor, dx: Tensor) -> Tensor:
    """dx: the gradient at x of rms(x) * weight (`torch_rms_back`), by `select`."""
    return select(dy).rms_back(dy, n, scale, weight, dx)


def l2n_relu(pre: Tensor, out: Tensor) -> Tensor:
    """out (..., H, dk) = l2n(relu(pre)) per head of pre (..., H * dk), by `select`."""
    return select(pre).l2n_relu(pre, out)


def cast_with_sums(x: Tensor, low: Tensor, sums: Tensor) -> Tensor:
    """low = x in low's dtype, sums += x.sum(0) (an adjoint's weight-gradient operand and its
    bias gradient), by `select`."""
    return select(x).cast_with_sums(x, low, sums)


def down_input(
    rg: Tensor | None, ro: Tensor | None, a: Tensor, b: Tensor, dtype: torch.dtype
) -> Tensor:
    """[silu(rg) * ro, silu(a) * b] in `dtype` (rg, ro None: silu(a) * b), by `select`."""
    return select(a).down_input(rg, ro, a, b, dtype)
