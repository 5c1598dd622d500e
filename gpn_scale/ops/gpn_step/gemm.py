"""The CUDA step backend's few-row GEMMs: how each is planned (tiles, warps, K split into
ranges that fill whole waves of the GPU) and launched (`triton_kernels.linear_kernel`, and
`linear_reduce_kernel` to sum a split one's partial products in a fixed order).

A step GEMM multiplies the batch's B rows by a weight it streams once per step, so its plan
is about bytes in flight and SMs kept busy, not FLOPs (docs/perf.md, the accounting's
`pricing.py`). `cuda.py` (the step host) calls `linear` for every GEMM of a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gpn_scale.ops.gpn_step import geometry
from gpn_scale.ops.gpn_step import triton_kernels as tk
from gpn_scale.ops.launch import is_dry
from gpn_scale.ops.launch import launch as _launch
from gpn_scale.ops.launch import nbytes as _nbytes
from gpn_scale.ops.launch import record_aten as _aten

MAX_SPLITS = 8
# A split-K sum reads a few hundred KB: narrow column blocks spread it over the SMs.
REDUCE_BLOCK_N = 16
# The epilogue after cuBLAS's product reads a block's row scales once a program (the read
# norm's sums: 156 a row at 130M): 16-column blocks of the input projection's 27,358 took 1,710
# programs, each reading them again (priced 44 us a step at B = 128, against 19 at 64 columns).
CUBLAS_EPILOGUE_N = 64


@dataclass(frozen=True)
class GemmPlan:
    """How one few-row GEMM is launched: tiles, warps and the split-K ranges."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    splits: int = 1
    splits_k1: int = 0  # of the splits, those over [0, k1) (the read norm's columns)
    k_per_split: int = 0
    stages: int = 3  # Triton's software pipeline depth (num_stages)
    # The launch applying the scale and epilogue apart from the product (a split's sum, or
    # after cuBLAS's product: `_cublas_epilogue_plan`) and its columns a program.
    separate_epilogue: bool = False
    reduce_n: int = REDUCE_BLOCK_N

    @property
    def epilogue_n(self) -> int:
        """Columns a program of the launch that applies the epilogue takes (its `low` sums'
        blocks)."""
        return self.reduce_n if self.splits > 1 or self.separate_epilogue else self.block_n

    def grid(self, M: int, N: int) -> tuple[int, ...]:
        g = (geometry.cdiv(M, self.block_m), geometry.cdiv(N, self.block_n))
        return (*g, self.splits) if self.splits > 1 else g

    def prefetch_meta(self, w: Tensor) -> dict[str, int]:
        """What a dependent launch prefetches into L2 while the kernel before it finishes:
        the weight rows its pipeline loads before the first product (its first
        num_stages - 1 K tiles, a power of two), one address a 128-byte line of `w`'s."""
        return dict(
            PREFETCH_K=geometry.p2(max(1, self.stages - 1) * self.block_k),
            PREFETCH_LINE=min(self.block_n, 128 // w.element_size()),
        )

    def meta(self) -> dict[str, int]:
        """`linear_kernel`'s meta-parameters for this plan."""
        return dict(
            SPLITS=self.splits, SPLITS_K1=self.splits_k1, K_PER_SPLIT=self.k_per_split,
            BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k,
            num_warps=self.warps, num_stages=self.stages,
        )  # fmt: skip


# bf16 weight panels 128 columns wide: each program keeps twice the weight bytes in flight
# (2 x 16 KB with Triton's 3 stages: 4.3 MB over the SMs, the copy bandwidth x latency an
# H200 needs), and half as many programs read the float32 A rows again (L2 -> SM bytes).
GEMM_BLOCK_N = 128


def gemm_plan(M: int, N: int, K: int, t: Tensor, k1: int = 0, ieee: bool = False) -> GemmPlan:
    """Few-row GEMMs stream the weight once: a block of the batch's rows against
    GEMM_BLOCK_N-column panels (32 x 32 tiles for float32/float64 operands, whose IEEE
    products run on the FMA units: 64-wide tiles spilled there). Where that gives fewer
    programs than the GPU has SMs (an output of width d: N / 128 = 20 programs at 130M), K
    is split into ranges (at most MAX_SPLITS, each a multiple of BLOCK_K, never straddling
    k1), as many as fit in one wave: rounding up instead left 1.06-1.5 programs per SM, a
    second wave that a few SMs run alone (accounting/pricing.py's partial wave). Unless the
    split's partials would outweigh the weight (`PARTIALS_SHARE`) and half-width panels fill
    the SMs unsplit: then those. A split float32 A operand over a long K takes
    double-width panels (`WIDE_PANEL_N`)."""
    if geometry.interpreting(t):
        bm, bn, bk, warps = 16, 16, 16, 1
    elif ieee:
        bm, bn, bk, warps = min(64, max(16, geometry.p2(M))), 32, 32, 4
    else:
        # 128 rows a program from B = 128: one row block streams each weight tile (two
        # row blocks read it at the same time, so only half their tiles in flight are HBM
        # bytes: accounting/pricing.py); 8 warps hold its 128-row accumulator and A tiles
        bm = min(128 if M >= 128 else 64, max(16, geometry.p2(M)))
        bn, bk, warps = GEMM_BLOCK_N, 64, 8 if bm == 128 else 4
    stages = 3
    if not ieee and bm == 128 and t.element_size() == 2:
        bk, stages = DEEP_PIPELINE
    programs = geometry.cdiv(M, bm) * geometry.cdiv(N, bn)
    sms = geometry.sm_count(t)
    if programs >= sms or K <= bk:
        return GemmPlan(bm, bn, bk, warps, stages=stages)
    if not ieee and t.element_size() == 4 and K >= WIDE_PANEL_MIN_K and geometry.arch(t) >= 90:
        bn = WIDE_PANEL_N
        bk, stages = (32, 5) if bm * bn // (32 * warps) >= 128 else (64, 3)
        programs = geometry.cdiv(M, bm) * geometry.cdiv(N, bn)
    splits, s1, per = _wave_splits(programs, sms, K, k1, bk)
    if splits <= 1:
        return GemmPlan(bm, bn, bk, warps, stages=stages)
    if bn == WIDE_PANEL_N:
        return GemmPlan(bm, bn, bk, warps, splits, s1, per, stages)
    narrow = GEMM_BLOCK_N // 2
    if (
        not ieee
        and _partials_outweigh(splits, M, N, K)
        and geometry.cdiv(M, bm) * geometry.cdiv(N, narrow) >= sms
    ):
        return GemmPlan(bm, narrow, bk, warps, stages=stages)
    return GemmPlan(bm, bn, bk, warps, splits, s1, per, stages)


# bf16 A rows in 128-row blocks (the input GEMM, the down GEMM and its dy W^T from B = 128):
# 32-deep K tiles 6 stages deep take the shared memory of 64-deep ones 3 deep (and so as many
# programs per SM) but keep 5 weight tiles ahead of the one in use instead of 2: 20-40 KB a
# program, where the 64-wide panels of the down GEMM's dy W^T drew 62% of the copy bandwidth
# (Little's law, accounting/pricing.py). Priced at B = 128 / 256: 1.215 -> 1.201 / 2.493 ->
# 2.456 s a step. A float32 A tile is twice the bytes: more stages of it would cost programs
# per SM; fewer rows (B < 128) priced slower this deep.
DEEP_PIPELINE = (32, 6)


# A split product with a float32 A operand over a long K (the input GEMM's dy W^T: the dY
# rows, K = 27,358 at 130M) re-reads its A rows in every column panel: with 128-wide panels
# twice the weight's bytes through L2, which bounds it there (accounting/pricing.py). 256-wide
# panels halve that and need half the programs, which leaves SMs to the side work beside the
# reverse sweep (ops/gpn_step/overlap.py): priced 49 -> 40 us a step at B = 128 and 96 -> 64
# at B = 256. Their accumulator (128 floats a thread from 64 x 256 on 4 warps or 128 x 256
# on 8) leaves registers for 32-deep K tiles only (64-deep spilled); 5 stages keep the same
# 64 KB of weight tiles ahead as 3 of the 64-deep ones. Over a short K (the fuse-gate's
# dy W^T, K = 2,496) the split's partials weigh on it: priced no faster, left narrow. Hopper
# only: wgmma keeps the operands in shared memory; mma.sync (sm_80) holds fragments of both
# in registers as well and spilled (8-20 B a thread, the compile gate).
WIDE_PANEL_N = 256
WIDE_PANEL_MIN_K = 8192


# A split's float32 partials are written, then read by the sum: worth it while they move
# less than this share of the bf16 weight's bytes. A wide output with a short K (the down
# GEMM's dy W^T at 130M: N = 10,496, K = 2,496) would move 1.6x its weight at B = 128 in
# 8 splits; the accounting prices its unsplit 64-wide panels faster there and at B = 64
# (0.8x), the split faster at B = 16 (0.2x). Only half-width panels: 32-wide ones over a
# long K (the d-wide GEMMs at B = 256) keep too few weight bytes in flight (priced 2-3x
# slower than their split).
PARTIALS_SHARE = 0.5


def _partials_outweigh(splits: int, M: int, N: int, K: int) -> bool:
    return 2 * splits * M * N * 4 > PARTIALS_SHARE * K * N * 2


def precision(w: Tensor) -> str | None:
    # float32 operands: IEEE products (Triton's default would be TF32, not what the state's
    # float32 promises); bf16 operands: the tensor cores' own.
    return "ieee" if w.dtype in (torch.float32, torch.float64) else None


def _widened(w: Tensor) -> bool:
    """Whether the kernel widens bf16 tiles to float32 (Triton's interpreter: its bf16 products
    are wrong; see `triton_kernels._mm_range`). Never on a GPU."""
    return geometry.interpreting(w) and w.dtype == torch.bfloat16


def readable_columns(w: Tensor) -> int:
    """Columns of the (K, N) weight a kernel may read: N rounded up to 16 where every row's
    stride and the storage hold them (the padded loop weights: `LoopWeights.for_matmul`),
    so that the weight tile's mask is a multiple of the vector width."""
    K, N = w.shape
    rounded = -(-N // 16) * 16
    if w.stride(1) != 1 or w.stride(0) < rounded:
        return N
    end = w.storage_offset() + (K - 1) * w.stride(0) + rounded
    storage = w.untyped_storage().nbytes() // w.element_size()
    return rounded if end <= storage else N


class SplitWorkspace:
    """What one chunk's step GEMMs share: the split-K partials' buffer, grown to the largest
    GEMM's need and reused by every split GEMM of the chunk (they run one after another on
    one stream, each reduce before the next GEMM writes), and the projections whose GEMMs
    go through cuBLAS (`engine.cublas_gemms`; options.PROJECTIONS)."""

    def __init__(self, like: Tensor, cublas: frozenset[str] = frozenset()) -> None:
        self.like = like
        self.buffer: Tensor | None = None
        self.cublas = cublas

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        if self.buffer is None or self.buffer.numel() < numel or self.buffer.dtype != dtype:
            self.buffer = self.like.new_empty(numel, dtype=dtype)
        return self.buffer[:numel]


def linear(
    a: Tensor,
    w: Tensor,
    out: Tensor,
    phase: str,
    name: str,
    *,
    bias: Tensor | None = None,
    row_rms: bool = False,
    eps: float = 0.0,
    split: tuple[Tensor, int] | None = None,
    ss_width: int | None = None,
    epilogue: int = 0,
    pg: Tensor | None = None,
    res: Tensor | None = None,
    fuse: Tensor | None = None,
    out2: Tensor | None = None,
    low: tuple[Tensor, Tensor] | None = None,
    workspace: SplitWorkspace | None = None,
    sum_in_consumer: bool = False,
    projection: str | None = None,
) -> Tensor | None:
    """out = epilogue(scale * (a @ w) + bias): see `triton_kernels.linear_kernel`.

    `projection` (options.PROJECTIONS): where the workspace sends it through cuBLAS, the
    product is cuBLAS's and the scale and epilogue `linear_reduce_kernel`'s (`_via_cublas`).

    `low` = (out_low (M, N) in the matmul dtype, sums (M, `epilogue_blocks(...)`)): the
    result is also written there, and its float32 sums of squares per column block of the
    launch that writes it, for the next GEMM to read as its A operand with split=(sums, N)
    (half the bytes of a float32 A; the RMS scale from the sums).

    `sum_in_consumer` (a plain product: no bias, scale or epilogue): a split product's
    partials are not summed here; they are returned, (splits, M, N), for the next launch
    to sum as it reads them (`triton_kernels._split_summed`), and `out` is not written.
    Returns None when the product was written to `out`."""
    M, K = a.shape
    N = w.shape[1]
    assert not sum_in_consumer or (
        bias is None and not row_rms and split is None and epilogue == 0 and out2 is None
    ), "only a plain product's split-K sum moves into its consumer"
    low_out, low_ss = low if low is not None else (None, None)
    for t in (out, pg, res, fuse, out2, low_out):
        assert t is None or t.stride(-1) == 1, "epilogue operands need unit column stride"
    ss, k1 = split if split is not None else (None, 0)
    assert not (row_rms and k1), "the read norm's split and a row RMS are not combined"
    cublas = workspace is not None and projection in workspace.cublas
    plan = gemm_plan(M, N, K, a, k1, ieee=precision(w) == "ieee")
    if cublas:
        plan = _cublas_epilogue_plan(plan, k1, K)
    assert low_ss is None or low_ss.shape[1] == epilogue_blocks(plan, N), "sums' blocks"
    dummy = geometry.unused_pointer(out)
    ep = _Epilogue(
        bias if bias is not None else dummy,
        ss if ss is not None else dummy,
        ss.stride(0) if ss is not None else 0,
        # (tensor or the placeholder, its row stride or 0) for each epilogue operand
        tuple(
            x
            for t in (pg, res, fuse, out2, low_out, low_ss)
            for x in ((dummy, 0) if t is None else (t, t.stride(0)))
        ),
        eps,
        _norm_meta(ss, k1, ss_width, row_rms, bias is not None, epilogue, out2, low, w),
        _nbytes(out, bias, ss, pg, res, fuse, out2, low_out, low_ss),
    )
    if cublas:
        assert workspace is not None  # (where the route is chosen)
        plain = not (bias is not None or row_rms or ss is not None or epilogue or out2 is not None
                     or low is not None)  # fmt: skip
        _via_cublas(a, w, out, phase, name, plan, k1, row_rms, plain, workspace, ep)
        return None
    return _via_triton(a, w, out, phase, name, plan, workspace, sum_in_consumer, ep)


@dataclass(frozen=True)
class _Epilogue:
    """What the launch applying a GEMM's scale and epilogue is given beside the product (the
    GEMM itself, or the sum of its partials after it): each pointer a tensor, or the
    placeholder and stride 0."""

    bias: Tensor
    ss: Tensor  # the read norm's sums of squares (split)
    ss_stride: int
    operands: tuple  # (tensor, row stride) for pg, res, fuse, out2, low_out, low_ss
    eps: float
    meta: dict  # `_norm_meta`
    nbytes: int  # the epilogue's operands and output

    def reduce_args(self, ws: Tensor, ws_ss: Tensor, out: Tensor, M: int, N: int, K: int) -> tuple:
        """`linear_reduce_kernel`'s arguments over the partials `ws` (and row sums `ws_ss`)."""
        return (ws, ws_ss, self.ss, self.ss_stride, self.bias, out, out.stride(0),
                *self.operands, M, N, K, self.eps)  # fmt: skip


def _via_triton(
    a: Tensor,
    w: Tensor,
    out: Tensor,
    phase: str,
    name: str,
    plan: GemmPlan,
    workspace: SplitWorkspace | None,
    sum_in_consumer: bool,
    ep: _Epilogue,
) -> Tensor | None:
    """`linear` as `linear_kernel`: product, scale and epilogue in one launch, or split over K
    into partials summed by `linear_reduce_kernel` (or by the consumer: returned)."""
    M, K = a.shape
    N = w.shape[1]
    ws = ws_ss = geometry.unused_pointer(out)  # (unsplit: the placeholder)
    if plan.splits > 1:
        ws_all = (workspace or SplitWorkspace(out)).take(plan.splits * M * (N + 1), out.dtype)
        ws, ws_ss = ws_all[: plan.splits * M * N], ws_all[plan.splits * M * N :]
    dependent = geometry.dependent_launch(a)
    _launch(
        tk.linear_kernel, plan.grid(M, N), name, phase,
        _nbytes(a, w) + (_nbytes(ws) if plan.splits > 1 else ep.nbytes), 2 * M * N * K,
        a, a.stride(0), a.stride(1), w, w.stride(0), w.stride(1), ep.bias, out, out.stride(0),
        ep.ss, ep.ss_stride, *ep.operands, ws, ws_ss, M, N, K, readable_columns(w), ep.eps,
        **ep.meta, PRECISION=precision(w), **plan.meta(),
        **dependent, **(plan.prefetch_meta(w) if dependent["PDL"] else {}),
    )  # fmt: skip
    if plan.splits == 1:
        return None
    if sum_in_consumer:
        return ws.view(plan.splits, M, N)
    _sum_splits(plan, M, N, f"{name} (split-K sum)", phase, _nbytes(ws) + ep.nbytes,
                ep.reduce_args(ws, ws_ss, out, M, N, K), ep.meta)  # fmt: skip
    return None


def _cublas_epilogue_plan(plan: GemmPlan, k1: int, K: int) -> GemmPlan:
    """How `linear_reduce_kernel` applies the scale and epilogue to cuBLAS's product: at
    most 64 rows on 4 warps a program (128 rows on 8 took up to 157 registers a thread:
    one program an SM), CUBLAS_EPILOGUE_N columns (its `low` sums' blocks), over the
    products of `_k_ranges`."""
    ranges = _k_ranges(k1, K)
    return GemmPlan(min(plan.block_m, 64), plan.block_n, plan.block_k, min(plan.warps, 4),
                    splits=len(ranges), splits_k1=1 if k1 else 0, separate_epilogue=True,
                    reduce_n=CUBLAS_EPILOGUE_N)  # fmt: skip


def _k_ranges(k1: int, K: int) -> tuple[tuple[int, int], ...]:
    """The ranges of K cuBLAS multiplies apart: the read norm's columns [0, k1) take their
    own scale (k1 = K: every column, the input GEMM reading a bf16 copy and its sums)."""
    if not k1:
        return ((0, K),)
    return ((0, k1), (k1, K)) if k1 < K else ((0, K),)


def _via_cublas(
    a: Tensor,
    w: Tensor,
    out: Tensor,
    phase: str,
    name: str,
    plan: GemmPlan,
    k1: int,
    row_rms: bool,
    plain: bool,
    workspace: SplitWorkspace,
    ep: _Epilogue,
) -> None:
    """`linear` through cuBLAS: a plain product straight into a contiguous `out`; otherwise
    the product (`_k_ranges`: two where the read norm's columns [0, k1) are scaled apart) into the
    workspace in out's dtype, A's row sums of squares beside it (row_rms), and the scale and
    epilogue by `linear_reduce_kernel` (`plan`: `_cublas_epilogue_plan`)."""
    M, K = a.shape
    N = w.shape[1]
    if plain and out.is_contiguous():
        _cublas_product(a, w, out, phase, name)
        return
    parts = plan.splits
    ws_all = workspace.take(parts * M * (N + 1), out.dtype)
    ws, ws_ss = ws_all[: parts * M * N], ws_all[parts * M * N :]
    for j, (lo, hi) in enumerate(_k_ranges(k1, K)):
        _cublas_product(a[:, lo:hi], w[lo:hi], ws[j * M * N : (j + 1) * M * N].view(M, N), phase,
                        name)  # fmt: skip
    if row_rms:
        _aten(f"{name} row sums of squares", phase, 2 * _nbytes(a) + M * out.element_size())
        if not is_dry():
            wide = a.to(out.dtype)
            torch.sum(wide * wide, dim=1, out=ws_ss[:M])
    _sum_splits(plan, M, N, f"{name} (epilogue)", phase, _nbytes(ws) + ep.nbytes,
                ep.reduce_args(ws, ws_ss, out, M, N, K), ep.meta)  # fmt: skip


def _cublas_product(a: Tensor, w: Tensor, out: Tensor, phase: str, name: str) -> None:
    """out = a @ w through cuBLAS, A rounded to the weight's dtype first (as the Triton GEMM
    rounds each tile it loads), accumulated and written in out's dtype (a bf16 product in
    float32: cuBLAS's dtype overload). Off the GPU (the tests) the same function widened:
    a product of two bf16 values is exact in float32."""
    M, K = a.shape
    a_mm = a
    if a.dtype != w.dtype:
        _aten(f"{name} A to {str(w.dtype)[6:]}", phase, _nbytes(a) + M * K * w.element_size())
        a_mm = a if is_dry() else a.to(w.dtype)
    nbytes = M * K * w.element_size() + _nbytes(w, out)
    _aten(f"{name} (cuBLAS)", phase, nbytes, 2 * M * K * w.shape[1], cublas=True)
    if is_dry():
        return
    if w.device.type == "cuda" and w.dtype != out.dtype:
        torch.mm(a_mm, w, out_dtype=out.dtype, out=out)
    else:
        torch.mm(a_mm.to(out.dtype), w.to(out.dtype), out=out)


def _norm_meta(
    ss: Tensor | None,
    k1: int,
    ss_width: int | None,
    row_rms: bool,
    has_bias: bool,
    epilogue: int,
    out2: Tensor | None,
    low: tuple[Tensor, Tensor] | None,
    w: Tensor,
) -> dict:
    """The scale's and the epilogue's compile-time settings, shared by a GEMM and its sum."""
    return dict(
        N_SS=geometry.p2(ss.shape[1]) if ss is not None else 1,
        SS_COLS=ss.shape[1] if ss is not None else 1,
        SPLIT_K1=k1,
        SS_WIDTH=ss_width or k1 or 1,
        ROW_RMS=row_rms,
        HAS_BIAS=has_bias,
        EPILOGUE=epilogue,
        HAS_OUT2=out2 is not None,
        HAS_LOW=low is not None,
        WIDEN=_widened(w),
    )


def _sum_splits(
    plan: GemmPlan,
    M: int,
    N: int,
    name: str,
    phase: str,
    nbytes: int,
    args: tuple,
    norm_meta: dict,
) -> None:
    """A split GEMM's partial products summed in a fixed order (deterministic), then its
    scale and epilogue: `linear_reduce_kernel` with `args` as it takes them."""
    _launch(
        tk.linear_reduce_kernel,
        (geometry.cdiv(M, plan.block_m), geometry.cdiv(N, plan.reduce_n)),
        name,
        phase,
        nbytes,
        plan.splits * M * N,
        *args,
        **norm_meta,
        SPLITS=plan.splits,
        SPLITS_K1=plan.splits_k1,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.reduce_n,
        num_warps=plan.warps,
        **geometry.dependent_launch(args[0]),
    )


def low_sums_width(a: Tensor, w: Tensor, k1: int = 0, cublas: bool = False) -> int:
    """The columns of the `low` sums that `linear(a, w, ..., split=(ss, k1))` writes
    (`epilogue_blocks`); `cublas`: through cuBLAS (its epilogue's blocks)."""
    (M, K), N = a.shape, w.shape[1]
    plan = gemm_plan(M, N, K, a, k1, ieee=precision(w) == "ieee")
    return epilogue_blocks(_cublas_epilogue_plan(plan, k1, K) if cublas else plan, N)


def epilogue_blocks(plan: GemmPlan, N: int) -> int:
    """How many column blocks the launch applying a GEMM's epilogue has (the columns of
    its `low` sums): the GEMM's own, or its split-K sum's."""
    return geometry.cdiv(N, plan.epilogue_n)


def wave_fill(programs: int, sms: int) -> float:
    """The share of its waves' program slots a grid fills (one program per SM a wave)."""
    return programs / (geometry.cdiv(programs, sms) * sms)


def _wave_splits(programs: int, sms: int, K: int, k1: int, bk: int) -> tuple[int, int, int]:
    """(splits, of them over [0, k1), K per split) for a grid of `programs` column tiles:
    of the ranges of K / n (n <= MAX_SPLITS, a multiple of bk, a range never straddling
    k1: that boundary can add one), the grid that fills its waves best, more splits on a
    tie."""
    best: tuple[float, int, int, int] = (0.0, 1, 0, K)
    for want in range(1, min(MAX_SPLITS, geometry.cdiv(K, bk)) + 1):
        per = geometry.cdiv(geometry.cdiv(K, want), bk) * bk
        s1 = geometry.cdiv(k1, per) if k1 else 0
        splits = s1 + geometry.cdiv(K - k1, per)
        best = max(best, (wave_fill(programs * splits, sms), splits, s1, per))
    return best[1], best[2], best[3]
