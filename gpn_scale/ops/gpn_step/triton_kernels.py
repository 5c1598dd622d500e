"""Triton kernels of the CUDA step backend (`cuda.py` launches them; `reference.py` is what
they compute). Three kinds:

- `linear_kernel`: a few-row GEMM (the batch's rows x a weight matrix streamed once) with the
  work around it fused into its prologue and epilogue: the RMSNorm of the input row as a row
  scale applied after the product (norm weights are folded into the matrices, so
  rms(x) @ W == rsqrt(mean(x^2) + eps) * (x @ W)), the bias, the gated residual of the
  down-projection (with the read's RMSNorm as a second row scale over its own K range), and
  the fuse gate with the grounding add.
- `memory_forward_kernel` / `memory_backward_kernel`: everything between the GEMMs of one
  layer in one launch, one program per (row, head) for the memory (the error term and the read
  over M0 plus the chunk's low-rank history, gates, l2-norms; in the backward the read and the
  write reversed with ONE pass over M0 for both) and one per (row, block of FFN columns).
- `rev_row_kernel`: the reverse sweep's row-wise pieces (an RMSNorm backward, which needs the
  whole row, then the next layer's start or the step's end), one program per row.

Every kernel of the time steps takes `PDL` (programmatic dependent launch, Hopper on; off
in the interpreter): launched with `launch_pdl`, it may start while the kernel before it in
the stream finishes, and waits for it (`_await_predecessor`) before its first read; each
program lets the next kernel start launching once only its final stores are left
(`_release_dependents`).

Accumulation is in the output's dtype (float32 under bf16 autocast: operands in bf16, the
state, the memory and every sum in float32). Under TRITON_INTERPRET=1 they run on CPU tensors
(float32 / float64; the interpreter has no bf16), which is how CI holds them to the reference.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

try:  # Grid dependency control (triton >= 3.2); `geometry.dependent_launch` checks for it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: PDL is never asked for
    gdc_launch_dependents = gdc_wait = None
from triton.language.extra.cuda import smid


@functools.cache
def triton_version() -> tuple[int, int]:
    """(major, minor) of the Triton that compiles these kernels: kernel settings whose
    compiled code differs by version (spills) are chosen by it."""
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _softplus(x):
    # torch's threshold: x above 20 is returned as is.
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _silu(x):
    return x * _sigmoid(x)


@triton.jit
def _silu_back(x, dy):
    sig = _sigmoid(x)
    return dy * sig * (1.0 + x * (1.0 - sig))


@triton.jit
def _l2n_relu(pre):
    x = tl.maximum(pre, 0.0)
    return x / tl.sqrt(tl.sum(x * x, axis=0) + 1e-12)


@triton.jit
def _l2n_relu_back(pre, dy):
    x = tl.maximum(pre, 0.0)
    rho = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) + 1e-12)
    y = x * rho
    return tl.where(pre > 0.0, rho * (dy - y * tl.sum(y * dy, axis=0)), 0.0)


# ------------------------------------------------------------ dependent launch (PDL)
# A kernel launched with `launch_pdl` may run beside the last programs of the kernel before it
# in the stream. Before `_await_predecessor` it must read and write nothing that kernel or an
# earlier one wrote or reads: only L2 prefetches (hints that change no value) go there.
@triton.jit
def _await_predecessor(PDL: tl.constexpr):
    """Wait until the kernel before this one in the stream has finished and its writes are
    visible (a no-op in a kernel launched without PDL)."""
    if PDL:
        gdc_wait()


@triton.jit
def _release_dependents(PDL: tl.constexpr):
    """Let the next kernel in the stream start launching (it waits for this one to finish
    before its own reads): called once only the program's final stores are left, so that its
    programs do not sit on the SMs the side stream's work runs on."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs, ok):
    """Ask for the lines at `ptrs` to be fetched into L2 (PTX prefetch.global.L2; where
    `ok` is false the address is not touched)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptrs, ok.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


# ----------------------------------------------------------------------------- GEMM
# Row strides of the (B, T, d)-strided views the step kernels read and write reach past
# 2**31 elements at large batches (130M: B > 420 at T = 2048): they are 64-bit arguments
# (`tl.int64`), so that row * stride is computed in 64 bits. Unit column strides stay
# untyped: Triton specialises an int equal to 1 as a constant, which the vectorised loads
# need.
@triton.jit
def _linear_epilogue(
    acc,
    rm,
    rn,
    M,
    N,
    BIAS,
    OUT,
    stride_om,
    PG,
    stride_pg,
    RES,
    stride_res,
    FUSE,
    stride_fuse,
    OUT2,
    stride_o2,
    LOW,
    stride_low,
    SS_LOW,
    stride_ss_low,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HAS_OUT2: tl.constexpr,
    HAS_LOW: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """acc (+ bias), then EPILOGUE 0: store; 1: sigmoid(PG) * RES + acc (the gated
    residual); 2: the fuse gate, sigmoid(acc) * RES + FUSE (OUT2 gets a copy when HAS_OUT2);
    3: RES + acc. HAS_LOW: LOW gets the result in its (matmul) dtype and SS_LOW[row, this
    program's column block] its float32 sum of squares, for a GEMM that reads the row next:
    it then loads half the bytes and takes its RMS scale from the sums (the `split` of
    `gemm.linear`)."""
    m_ok = rm < M
    n_ok = rn < N
    if HAS_BIAS:
        acc = acc + tl.load(BIAS + rn, mask=n_ok, other=0.0)[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if EPILOGUE == 1:
        pg = tl.load(PG + rm[:, None] * stride_pg + rn[None, :], mask=ok, other=0.0)
        res = tl.load(RES + rm[:, None] * stride_res + rn[None, :], mask=ok, other=0.0)
        acc = _sigmoid(pg) * res + acc
    if EPILOGUE == 2:
        res = tl.load(RES + rm[:, None] * stride_res + rn[None, :], mask=ok, other=0.0)
        fuse = tl.load(FUSE + rm[:, None] * stride_fuse + rn[None, :], mask=ok, other=0.0)
        acc = _sigmoid(acc) * res + fuse
        if HAS_OUT2:
            tl.store(OUT2 + rm[:, None] * stride_o2 + rn[None, :], acc, mask=ok)
    if EPILOGUE == 3:
        res = tl.load(RES + rm[:, None] * stride_res + rn[None, :], mask=ok, other=0.0)
        acc = res + acc
    tl.store(OUT + rm[:, None] * stride_om + rn[None, :], acc, mask=ok)
    if HAS_LOW:
        kept = tl.where(ok, acc, 0.0)
        tl.store(
            SS_LOW + rm * stride_ss_low + tl.program_id(1), tl.sum(kept * kept, axis=1), mask=m_ok
        )
        tl.store(LOW + rm[:, None] * stride_low + rn[None, :], _rounded(kept, WIDEN), mask=ok)


@triton.jit
def _rounded(x, WIDEN: tl.constexpr):
    """x as a store to bf16 rounds it on the GPU (to nearest even); under the interpreter
    (WIDEN) rounded so first (see `_mm_range`). Triton's own interpreter truncates; since
    ops/triton_interpreter.py rounds its casts for every launch through ops.launch, this is
    a second guard there, kept until the WIDEN paths are pruned."""
    if WIDEN:
        xb = x.to(tl.float32).to(tl.uint32, bitcast=True)
        xb = (xb + 0x7FFF + ((xb >> 16) & 1)) & 0xFFFF0000
        return xb.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _read_norm_scale(
    SS, stride_ss, rm, m_ok, eps, N_SS: tl.constexpr, SS_COLS: tl.constexpr, SS_WIDTH: tl.constexpr
):
    """rsqrt(sum(SS_row) / SS_WIDTH + eps) per row (an RMSNorm whose sums of squares the
    producing kernel left: the memory kernel's per head, an epilogue's per column block),
    summed SS_BLOCK columns at a time (a tile of a few registers a thread)."""
    SS_BLOCK: tl.constexpr = 32 if N_SS > 32 else N_SS
    total = tl.zeros(rm.shape, dtype=SS.dtype.element_ty)
    for j in tl.static_range(0, N_SS, SS_BLOCK):
        rs = j + tl.arange(0, SS_BLOCK)
        part = tl.load(
            SS + rm[:, None] * stride_ss + rs[None, :],
            mask=m_ok[:, None] & (rs < SS_COLS)[None, :],
            other=0.0,
        )
        total += tl.sum(part, axis=1)
    return 1.0 / tl.sqrt(total / SS_WIDTH + eps)


@triton.jit
def _mm_range(
    A,
    stride_am,
    stride_ak,
    W,
    stride_wk,
    stride_wn,
    rm,
    rn,
    m_ok,
    n_ok,
    k_lo,
    k_hi,
    acc,
    ss,
    ROW_RMS: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc += A[rm, k_lo:k_hi] @ W[k_lo:k_hi, rn]; with ROW_RMS also ss += sum(A_row^2).

    WIDEN (the interpreter only, bf16 W): Triton's interpreter multiplies bf16 tiles wrongly
    (3.8: 1e10 off) and casts to bf16 by truncation, so there the tiles are widened to
    float32 first, A rounded to bf16 values as the GPU rounds: a product of two bf16 values
    is exact in float32, summed in float32, as the tensor cores do."""
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_hi
        a = tl.load(
            A + rm[:, None] * stride_am + rk[None, :] * stride_ak,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        if ROW_RMS:
            af = a.to(acc.dtype)
            ss += tl.sum(af * af, axis=1)
        w = tl.load(
            W + rk[:, None] * stride_wk + rn[None, :] * stride_wn,
            mask=k_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        if WIDEN:
            # A rounded to bf16 to nearest even, as the GPU's cast does (the interpreter's
            # own cast truncates), kept in float32.
            acc = tl.dot(
                _rounded(a, WIDEN),
                w.to(tl.float32),
                acc,
                input_precision="ieee",
                out_dtype=acc.dtype,
            )
        else:
            acc = tl.dot(a.to(w.dtype), w, acc, input_precision=PRECISION, out_dtype=acc.dtype)
    return acc, ss


@triton.jit
def linear_kernel(
    A,
    stride_am: tl.int64,
    stride_ak,  # (M, K) input rows
    W,
    stride_wk,
    stride_wn,  # (K, N) weight
    BIAS,  # (N,) or unused
    OUT,
    stride_om: tl.int64,  # (M, N) output (unit column stride)
    SS,
    stride_ss: tl.int64,  # (M, n_ss) partial sums of squares (SPLIT_K1 > 0)
    PG,
    stride_pg: tl.int64,  # EPILOGUE 1: gate pre-activations (M, N)
    RES,
    stride_res: tl.int64,  # EPILOGUE 1, 2, 3: the residual / gated state (M, N)
    FUSE,
    stride_fuse: tl.int64,  # EPILOGUE 2: the grounding input (M, N)
    OUT2,
    stride_o2: tl.int64,  # EPILOGUE 2: a second copy of the output (S_out)
    LOW,
    stride_low: tl.int64,  # HAS_LOW: the output in the matmul dtype (M, N)
    SS_LOW,
    stride_ss_low: tl.int64,  # HAS_LOW: its sums of squares per column block (M, blocks)
    WS,  # SPLITS > 1: (SPLITS, M, N) float32 partial products
    WS_SS,  # SPLITS > 1 and ROW_RMS: (SPLITS, M) partial sums of squares
    M,
    N,
    K,
    NW,  # columns of W that may be read: N rounded up within its row stride (see cuda.py)
    eps,
    N_SS: tl.constexpr,
    SS_COLS: tl.constexpr,
    SPLIT_K1: tl.constexpr,
    SS_WIDTH: tl.constexpr,
    ROW_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HAS_OUT2: tl.constexpr,
    HAS_LOW: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,  # the interpreter's bf16 products (see `_mm_range`)
    SPLITS: tl.constexpr,
    SPLITS_K1: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
    PREFETCH_K: tl.constexpr = 0,
    PREFETCH_LINE: tl.constexpr = 64,
):
    """OUT = epilogue(scale * (A @ W) + bias); see `_linear_epilogue`.

    ROW_RMS: scale = rsqrt(mean(A_row^2) + eps), summed while A streams through the K loop.
    SPLIT_K1 > 0: columns [0, SPLIT_K1) of A get the row scale rsqrt(sum(SS_row) / SS_WIDTH +
    eps) (the read's RMSNorm, its sums of squares left by the memory kernel; SS_WIDTH is
    SPLIT_K1, or under tensor parallelism the full width when SS holds the group's sums),
    the rest none.
    SPLITS > 1 (split-K, grid axis 2): program s multiplies one K range (K_PER_SPLIT wide;
    the first SPLITS_K1 ranges cover [0, SPLIT_K1), the others [SPLIT_K1, K)) and writes
    its raw partial product (and partial sum of squares) to WS; `linear_reduce_kernel` sums
    them in a fixed order (deterministic) and applies scale and epilogue. A few-row GEMM
    whose output is narrow (N = d) would otherwise run on N / BLOCK_N programs, a third of
    the SMs, while it streams most of a step's weight bytes.
    PDL: the first PREFETCH_K rows of the program's weight tiles (what the pipeline's first
    stages load) are prefetched into L2 while the kernel before finishes: no step writes
    a weight.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    # The weight tile's column mask runs to NW, a multiple of 16 where the padded rows allow:
    # a mask at N = 27,358 would keep Triton from reading W 16 bytes at a time. Columns past
    # N are read (padding, or a neighbouring block) and never stored.
    w_ok = rn < NW
    acc_t = OUT.dtype.element_ty
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_t)
    ss = tl.zeros((BLOCK_M,), dtype=acc_t)
    s = tl.program_id(2)
    if SPLITS > 1:
        if s < SPLITS_K1:
            k_lo = s * K_PER_SPLIT
            k_hi = tl.minimum(k_lo + K_PER_SPLIT, SPLIT_K1)
        else:
            k_lo = SPLIT_K1 + (s - SPLITS_K1) * K_PER_SPLIT
            k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    else:
        k_lo = 0
        k_hi = K
    if PDL and PREFETCH_K > 0:
        rp = k_lo + tl.arange(0, PREFETCH_K)
        # one address a 128-byte line (PREFETCH_LINE elements): the columns are contiguous
        rl = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // PREFETCH_LINE) * PREFETCH_LINE
        _prefetch_l2(
            W + rp[:, None] * stride_wk + rl[None, :] * stride_wn,
            (rp < k_hi)[:, None] & (rl < NW)[None, :],
        )
    _await_predecessor(PDL)
    if SPLITS > 1:
        acc, ss = _mm_range(
            A,
            stride_am,
            stride_ak,
            W,
            stride_wk,
            stride_wn,
            rm,
            rn,
            m_ok,
            w_ok,
            k_lo,
            k_hi,
            zeros,
            ss,
            ROW_RMS,
            PRECISION,
            WIDEN,
            BLOCK_K,
        )
        _release_dependents(PDL)
        ok = m_ok[:, None] & (rn < N)[None, :]
        tl.store(WS + (s * M + rm[:, None]) * N + rn[None, :], acc, mask=ok)
        if ROW_RMS:
            if pid_n == 0:
                tl.store(WS_SS + s * M + rm, ss, mask=m_ok)
    else:
        acc = zeros
        if SPLIT_K1 > 0:
            acc1, ss = _mm_range(
                A,
                stride_am,
                stride_ak,
                W,
                stride_wk,
                stride_wn,
                rm,
                rn,
                m_ok,
                w_ok,
                0,
                SPLIT_K1,
                zeros,
                ss,
                False,
                PRECISION,
                WIDEN,
                BLOCK_K,
            )
            rr = _read_norm_scale(SS, stride_ss, rm, m_ok, eps, N_SS, SS_COLS, SS_WIDTH)
            acc = acc1 * rr[:, None]
        acc2, ss = _mm_range(
            A,
            stride_am,
            stride_ak,
            W,
            stride_wk,
            stride_wn,
            rm,
            rn,
            m_ok,
            w_ok,
            SPLIT_K1,
            K,
            zeros,
            ss,
            ROW_RMS,
            PRECISION,
            WIDEN,
            BLOCK_K,
        )
        if ROW_RMS:
            acc2 = acc2 * (1.0 / tl.sqrt(ss / K + eps))[:, None]
        acc = acc + acc2
        _release_dependents(PDL)
        _linear_epilogue(
            acc,
            rm,
            rn,
            M,
            N,
            BIAS,
            OUT,
            stride_om,
            PG,
            stride_pg,
            RES,
            stride_res,
            FUSE,
            stride_fuse,
            OUT2,
            stride_o2,
            LOW,
            stride_low,
            SS_LOW,
            stride_ss_low,
            HAS_BIAS,
            EPILOGUE,
            HAS_OUT2,
            HAS_LOW,
            WIDEN,
        )


@triton.jit
def _splits_sum(P, split_stride, offsets, ok, FIRST: tl.constexpr, LAST: tl.constexpr):
    """Partial products FIRST..LAST - 1 of a split GEMM at `offsets` (each `split_stride`
    elements after the last), summed in split order from zero: the one order every reader of
    the partials sums them in (`linear_reduce_kernel`, `rev_row_kernel`)."""
    acc = tl.zeros(offsets.shape, dtype=P.dtype.element_ty)
    for s in tl.static_range(FIRST, LAST):
        acc += tl.load(P + s * split_stride + offsets, mask=ok, other=0.0)
    return acc


@triton.jit
def linear_reduce_kernel(
    WS,  # (SPLITS, M, N) partial products of `linear_kernel`
    WS_SS,  # (SPLITS, M) partial sums of squares (ROW_RMS)
    SS,
    stride_ss: tl.int64,
    BIAS,
    OUT,
    stride_om: tl.int64,
    PG,
    stride_pg: tl.int64,
    RES,
    stride_res: tl.int64,
    FUSE,
    stride_fuse: tl.int64,
    OUT2,
    stride_o2: tl.int64,
    LOW,
    stride_low: tl.int64,
    SS_LOW,
    stride_ss_low: tl.int64,
    M,
    N,
    K,
    eps,
    N_SS: tl.constexpr,
    SS_COLS: tl.constexpr,
    SPLIT_K1: tl.constexpr,
    SS_WIDTH: tl.constexpr,
    ROW_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EPILOGUE: tl.constexpr,
    HAS_OUT2: tl.constexpr,
    HAS_LOW: tl.constexpr,
    WIDEN: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_K1: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The split-K sum of `linear_kernel`'s partials, in split order, then its scale and
    epilogue (what the kernel does itself without splits)."""
    _await_predecessor(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    ok = m_ok[:, None] & (rn < N)[None, :]
    tile = rm[:, None] * N + rn[None, :]
    acc_t = OUT.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_t)
    if SPLITS_K1 > 0:
        acc = _splits_sum(WS, M * N, tile, ok, 0, SPLITS_K1)
        acc = acc * _read_norm_scale(SS, stride_ss, rm, m_ok, eps, N_SS, SS_COLS, SS_WIDTH)[:, None]
    acc2 = _splits_sum(WS, M * N, tile, ok, SPLITS_K1, SPLITS)
    if ROW_RMS:
        ss = tl.zeros((BLOCK_M,), dtype=acc_t)
        for s in tl.static_range(SPLITS):
            ss += tl.load(WS_SS + s * M + rm, mask=m_ok, other=0.0)
        acc2 = acc2 * (1.0 / tl.sqrt(ss / K + eps))[:, None]
    acc = acc + acc2
    _release_dependents(PDL)
    _linear_epilogue(
        acc,
        rm,
        rn,
        M,
        N,
        BIAS,
        OUT,
        stride_om,
        PG,
        stride_pg,
        RES,
        stride_res,
        FUSE,
        stride_fuse,
        OUT2,
        stride_o2,
        LOW,
        stride_low,
        SS_LOW,
        stride_ss_low,
        HAS_BIAS,
        EPILOGUE,
        HAS_OUT2,
        HAS_LOW,
        WIDEN,
    )


# ---------------------------------------------------- tensor parallelism: split points
@triton.jit
def gated_residual_kernel(
    X,
    stride_x: tl.int64,
    PG,
    stride_pg: tl.int64,
    RES,
    stride_res: tl.int64,
    OUT,
    stride_out: tl.int64,
    SS,  # (B, SS_COLS) the group's summed read sums of squares (NORM only)
    D,
    eps,
    SS_WIDTH: tl.constexpr,
    N_SS: tl.constexpr,
    SS_COLS: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """OUT = sigmoid(PG) * RES + X, grid (B,): the down-projection's gated residual once
    its row-parallel output X (B, D) has been summed over the tp group. NORM (GPN+M): X is
    (B, 2 D), the read part (unnormalised) then the FFN part, summed in one all-reduce with
    SS; the read norm's scale r = rsqrt(sum(SS row) / SS_WIDTH + eps) applies here:
    OUT = sigmoid(PG) * RES + r * X[:, :D] + X[:, D:]."""
    _await_predecessor(PDL)
    _release_dependents(PDL)
    b = tl.program_id(0)
    r = 1.0
    if NORM:
        rs = tl.arange(0, N_SS)
        part = tl.load(SS + b * SS_COLS + rs, mask=rs < SS_COLS, other=0.0)
        r = 1.0 / tl.sqrt(tl.sum(part, axis=0) / SS_WIDTH + eps)
    for d0 in range(0, D, BLOCK_D):
        rd = d0 + tl.arange(0, BLOCK_D)
        ok = rd < D
        x = tl.load(X + b * stride_x + rd, mask=ok, other=0.0)
        if NORM:
            x = r * x + tl.load(X + b * stride_x + D + rd, mask=ok, other=0.0)
        pg = tl.load(PG + b * stride_pg + rd, mask=ok, other=0.0)
        res = tl.load(RES + b * stride_res + rd, mask=ok, other=0.0)
        tl.store(OUT + b * stride_out + rd, _sigmoid(pg) * res + x, mask=ok)


@triton.jit
def read_norm_sums_kernel(
    O_READ,
    RO,
    stride_o: tl.int64,  # (B, HV) this rank's read output and its RMSNorm
    DH,
    stride_dh: tl.int64,  # (B, HV + F): its first HV columns the read's gradient
    Y,
    stride_y: tl.int64,  # (B, width): the read gate at COL_RGATE
    SUMS,  # (B, 2) out: sum(o^2), sum(dn * ro) over this rank's HV columns
    COL_RGATE: tl.constexpr,
    HV: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The read norm backward's row sums over this rank's columns, grid (B,): summed over
    the tp group, then `memory_backward_kernel` reads them."""
    _await_predecessor(PDL)
    _release_dependents(PDL)
    b = tl.program_id(0)
    acc_t = SUMS.dtype.element_ty
    sx = tl.sum(tl.zeros((BLOCK_HV,), dtype=acc_t), axis=0)
    sdn = tl.sum(tl.zeros((BLOCK_HV,), dtype=acc_t), axis=0)
    for c0 in range(0, HV, BLOCK_HV):
        rj = c0 + tl.arange(0, BLOCK_HV)
        j_ok = rj < HV
        x = tl.load(O_READ + b * stride_o + rj, mask=j_ok, other=0.0)
        sx += tl.sum(x * x, axis=0)
        dn = tl.load(DH + b * stride_dh + rj, mask=j_ok, other=0.0) * _silu(
            tl.load(Y + b * stride_y + COL_RGATE + rj, mask=j_ok, other=0.0)
        )
        sdn += tl.sum(dn * tl.load(RO + b * stride_o + rj, mask=j_ok, other=0.0), axis=0)
    tl.store(SUMS + b * 2, sx)
    tl.store(SUMS + b * 2 + 1, sdn)


# ------------------------------------------------------------------ first key of a chunk
@triton.jit
def l2n_relu_kernel(
    X,
    stride_x,
    OUT,
    stride_ob,
    stride_oh,
    DK: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """OUT[b, h] = l2n(relu(X[b, h*DK:(h+1)*DK])): grid (B, H)."""
    _await_predecessor(PDL)
    _release_dependents(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    rk = tl.arange(0, BLOCK_DK)
    ok = rk < DK
    pre = tl.load(X + b * stride_x + h * DK + rk, mask=ok, other=0.0)
    tl.store(OUT + b * stride_ob + h * stride_oh + rk, _l2n_relu(pre), mask=ok)


# ------------------------------------------------------------ memory kernels' item queue
# The memory kernels' item queue (with RESERVED_SMS > 0, engine.side_work_sm_share): one int32
# counter per launch, zero before it (a chunk zeroes one per step and layer at once:
# `cuda_shared.side_work_queue`), each on its own 128-byte line (atomics on one address queue
# up at its L2 slice). Nothing resets it.
QUEUE_STRIDE = 32


@triton.jit
def _sm_id(EMULATED_SMS: tl.constexpr):
    """The SM this program runs on. The interpreter has no %smid: with EMULATED_SMS > 0 (the
    tests) program i stands on SM i mod EMULATED_SMS."""
    if EMULATED_SMS > 0:
        return (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) % EMULATED_SMS
    else:
        return smid()


@triton.jit
def _first_item(QUEUE, items, RESERVED_SMS: tl.constexpr, EMULATED_SMS: tl.constexpr):
    """This program's first item, or `items` (none): a program on one of the first
    RESERVED_SMS SMs leaves its SM to the side stream's work, except the grid's last program
    (whatever the block scheduler does, it runs and takes what the others have not; the grid
    has one program per item, so items = programs)."""
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    item = items
    if (_sm_id(EMULATED_SMS) >= RESERVED_SMS) | (pid + 1 == items):
        item = tl.atomic_add(QUEUE, 1)
    return item


@triton.jit
def _indices(zero, N: tl.constexpr):
    """0, 1, ..., N - 1, plus `zero` (0; see `_memory_backward_program`). The hints restore
    what the compiler knew of the plain range (contiguous, starting at a multiple of N), which
    its loads are vectorised by."""
    return tl.max_contiguous(tl.multiple_of(zero + tl.arange(0, N), N), N)


# ------------------------------------------------------------------- memory, forward
# The step index is an argument, not a specialisation: Triton's JIT would otherwise compile
# separate variants for tau == 1 and for tau % 16 == 0 (three compiles of the largest
# kernels, minutes on first use).
@triton.jit
def _memory_forward_program(
    b,
    h,
    zero,
    Y,
    stride_y: tl.int64,  # (B, width) this layer's input-GEMM output at this step
    HID,
    stride_hid: tl.int64,  # (B, H*DV + F) the down-projection's input
    SS,  # (B, H) per-head sums of squares of the read output
    KCUR,  # (B, H, DK) the current key (WRITE: replaced by the next)
    GPREV,  # (B, H) G_{t-1} (WRITE: replaced by G_t)
    M0,
    s_m0b: tl.int64,
    s_m0h,
    s_m0k,  # (B, H, DK, DV) chunk-start memory (unit last stride)
    KH,
    s_khb: tl.int64,
    s_khh,
    s_khc,  # (B, H, C, DK) the chunk's keys
    UH,
    s_uhb: tl.int64,
    s_uhh,
    s_uhc,  # (B, H, C, DV) the chunk's errors u_j
    GH,
    s_ghb: tl.int64,
    s_ghh,  # (B, H, C) the chunk's cumulative log-decays
    A,  # (H,) decay rates exp(A_log)
    tau,  # the step within the chunk
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    F: tl.constexpr,
    HV: tl.constexpr,
    COL_KEY: tl.constexpr,
    COL_VALUE: tl.constexpr,
    COL_BETA: tl.constexpr,
    COL_DECAY: tl.constexpr,
    COL_QUERY: tl.constexpr,
    COL_RGATE: tl.constexpr,
    COL_FFN: tl.constexpr,
    WRITE: tl.constexpr,
    MEMORY: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_F: tl.constexpr,
    STAGES: tl.constexpr,
    RELEASE: tl.constexpr,
):
    """One (row, head or FFN block) item of `memory_forward_kernel`; `zero` and RELEASE as
    for `_memory_backward_program`."""
    tau = tau + zero
    if h >= H:
        rf = (h - H) * BLOCK_F + _indices(zero, BLOCK_F)
        f_ok = rf < F
        fa = tl.load(Y + b * stride_y + COL_FFN + rf, mask=f_ok, other=0.0)
        fb = tl.load(Y + b * stride_y + COL_FFN + F + rf, mask=f_ok, other=0.0)
        tl.store(HID + b * stride_hid + HV + rf, _silu(fa) * fb, mask=f_ok)
    elif MEMORY:
        acc_t = SS.dtype.element_ty
        rk = _indices(zero, BLOCK_DK)
        k_ok = rk < DK
        rv = _indices(zero, BLOCK_DV)
        v_ok = rv < DV
        rr = _indices(zero, BLOCK_R)
        y_row = Y + b * stride_y
        kh_base = KH + b * s_khb + h * s_khh
        uh_base = UH + b * s_uhb + h * s_uhh
        gh_base = GH + b * s_ghb + h * s_ghh
        m0_base = M0 + b * s_m0b + h * s_m0h
        kcur = KCUR + (b * H + h) * DK
        # Every load whose address is known is issued here, before the loops (a loop's end
        # and a store each hold back later loads: a round trip each).
        q_pre = tl.maximum(tl.load(y_row + COL_QUERY + h * DK + rk, mask=k_ok, other=0.0), 0.0)
        rg = tl.load(y_row + COL_RGATE + h * DV + rv, mask=v_ok, other=0.0)
        if WRITE:
            k = tl.load(kcur + rk, mask=k_ok, other=0.0)
            Gp = tl.load(GPREV + b * H + h)
            decay_pre = tl.load(y_row + COL_DECAY + h)
            a_h = tl.load(A + h)
            beta = _sigmoid(tl.load(y_row + COL_BETA + h))
            v = tl.load(y_row + COL_VALUE + h * DV + rv, mask=v_ok, other=0.0)
            k_next = _l2n_relu(tl.load(y_row + COL_KEY + h * DK + rk, mask=k_ok, other=0.0))
            G = Gp - a_h * _softplus(decay_pre)
            n_hist = tau  # the write's error sees j < t
        else:
            G = tl.load(gh_base + tau)
            n_hist = tau + 1  # the read sees this step's write
        q_scale = 1.0 / tl.sqrt(tl.sum(q_pre * q_pre, axis=0) + 1e-12)
        q = q_pre * q_scale
        q_scale_eG = q_scale * tl.exp(G)
        if WRITE:
            eGp = tl.exp(Gp)
        # o = e^G M0^T q + sum_{j < n} e^{G - G_j} (q . k_j) u_j, and for the write
        # err = e^{Gp} M0^T k + sum_{j < t} e^{Gp - G_j} (k . k_j) u_j
        acc_o = tl.zeros((BLOCK_R, BLOCK_DV), dtype=acc_t)
        if WRITE:
            acc_e = tl.zeros((BLOCK_R, BLOCK_DV), dtype=acc_t)
        for d0 in tl.range(0, DK, BLOCK_R, num_stages=STAGES):
            rows = d0 + rr
            r_ok = rows < DK
            m0 = tl.load(
                m0_base + rows[:, None] * s_m0k + rv[None, :],
                mask=r_ok[:, None] & v_ok[None, :],
                other=0.0,
            )
            # the key rows' q and k read again (L1 hits): a register tensor cannot be sliced
            qb = tl.load(y_row + COL_QUERY + h * DK + rows, mask=r_ok, other=0.0)
            acc_o += tl.maximum(qb, 0.0)[:, None] * m0  # scaled once, after the loop
            if WRITE:
                kb = tl.load(kcur + rows, mask=r_ok, other=0.0)
                acc_e += kb[:, None] * m0
        # the history's rows in blocks of their own (a row of it is 1.5 times one of M0)
        o = q_scale_eG * tl.sum(acc_o, axis=0)
        hist_o = tl.zeros((BLOCK_J, BLOCK_DV), dtype=acc_t)
        if WRITE:
            err = eGp * tl.sum(acc_e, axis=0)
            hist_e = tl.zeros((BLOCK_J, BLOCK_DV), dtype=acc_t)
        for c0 in tl.range(0, n_hist, BLOCK_J, num_stages=STAGES):
            rows = c0 + _indices(zero, BLOCK_J)
            r_ok = rows < n_hist
            Kh = tl.load(
                kh_base + rows[:, None] * s_khc + rk[None, :],
                mask=r_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            Uh = tl.load(
                uh_base + rows[:, None] * s_uhc + rv[None, :],
                mask=r_ok[:, None] & v_ok[None, :],
                other=0.0,
            )
            Gj = tl.load(gh_base + rows, mask=r_ok, other=0.0)
            cq = tl.where(r_ok, tl.sum(Kh * q[None, :], axis=1) * tl.exp(G - Gj), 0.0)
            hist_o += cq[:, None] * Uh
            if WRITE:
                ck = tl.where(r_ok, tl.sum(Kh * k[None, :], axis=1) * tl.exp(Gp - Gj), 0.0)
                hist_e += ck[:, None] * Uh
        o += tl.sum(hist_o, axis=0)
        _release_dependents(RELEASE)  # (the FFN programs release when they end)
        if WRITE:
            u = beta * (v - (err + tl.sum(hist_e, axis=0)))
            o = o + tl.sum(q * k, axis=0) * u
            tl.store(uh_base + tau * s_uhc + rv, u, mask=v_ok)
        tl.store(HID + b * stride_hid + h * DV + rv, _silu(rg) * o, mask=v_ok)
        tl.store(SS + b * H + h, tl.sum(tl.where(v_ok, o * o, 0.0), axis=0))
        if WRITE:
            tl.store(kh_base + tau * s_khc + rk, k, mask=k_ok)
            tl.store(gh_base + tau, G)
            tl.store(GPREV + b * H + h, G)
            tl.store(kcur + rk, k_next, mask=k_ok)


# ----------------------------------------------------------------- reverse, row-wise


@triton.jit(do_not_specialize=["tau"])
def memory_forward_kernel(
    Y,
    stride_y: tl.int64,  # (B, width) this layer's input-GEMM output at this step
    HID,
    stride_hid: tl.int64,  # (B, H*DV + F) the down-projection's input
    SS,  # (B, H) per-head sums of squares of the read output
    KCUR,  # (B, H, DK) the current key (WRITE: replaced by the next)
    GPREV,  # (B, H) G_{t-1} (WRITE: replaced by G_t)
    M0,
    s_m0b: tl.int64,
    s_m0h,
    s_m0k,  # (B, H, DK, DV) chunk-start memory (unit last stride)
    KH,
    s_khb: tl.int64,
    s_khh,
    s_khc,  # (B, H, C, DK) the chunk's keys
    UH,
    s_uhb: tl.int64,
    s_uhh,
    s_uhc,  # (B, H, C, DV) the chunk's errors u_j
    GH,
    s_ghb: tl.int64,
    s_ghh,  # (B, H, C) the chunk's cumulative log-decays
    A,  # (H,) decay rates exp(A_log)
    QUEUE,  # RESERVED_SMS > 0: this launch's item counter (`QUEUE_STRIDE`), zero
    tau,  # the step within the chunk
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    F: tl.constexpr,
    HV: tl.constexpr,
    COL_KEY: tl.constexpr,
    COL_VALUE: tl.constexpr,
    COL_BETA: tl.constexpr,
    COL_DECAY: tl.constexpr,
    COL_QUERY: tl.constexpr,
    COL_RGATE: tl.constexpr,
    COL_FFN: tl.constexpr,
    WRITE: tl.constexpr,
    MEMORY: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_F: tl.constexpr,
    STAGES: tl.constexpr,
    RESERVED_SMS: tl.constexpr = 0,
    EMULATED_SMS: tl.constexpr = 0,  # the interpreter's stand-in for %smid (`_sm_id`)
    PDL: tl.constexpr = False,
):
    """Grid (B, H + ceil(F / BLOCK_F)): program (b, h < H) runs head h of the memory (the
    write at layer 0, then the read); the others one block of FFN columns.

    A head program holds all DV (BLOCK_DV) value columns and walks the rows of M0 and of
    the chunk's history in blocks of BLOCK_R, both loops software-pipelined. The products
    are accumulated elementwise in (BLOCK_R, BLOCK_DV) tiles and summed over the rows once,
    after both loops: a sum over rows in every iteration crossed the warps (shared memory
    and barriers) and its shuffles took most of the loop's instructions.
    RESERVED_SMS > 0 (engine.side_work_sm_share, with the decode beside the steps): the
    programs that land on the first RESERVED_SMS SMs leave them to the decode, and the others
    take the grid's items from a counter, as `memory_backward_kernel` does."""
    _await_predecessor(PDL)
    if RESERVED_SMS == 0:
        _memory_forward_program(
            tl.program_id(0),
            tl.program_id(1),
            0,
            Y,
            stride_y,
            HID,
            stride_hid,
            SS,
            KCUR,
            GPREV,
            M0,
            s_m0b,
            s_m0h,
            s_m0k,
            KH,
            s_khb,
            s_khh,
            s_khc,
            UH,
            s_uhb,
            s_uhh,
            s_uhc,
            GH,
            s_ghb,
            s_ghh,
            A,
            tau,
            H,
            DK,
            DV,
            F,
            HV,
            COL_KEY,
            COL_VALUE,
            COL_BETA,
            COL_DECAY,
            COL_QUERY,
            COL_RGATE,
            COL_FFN,
            WRITE,
            MEMORY,
            BLOCK_DK,
            BLOCK_DV,
            BLOCK_R,
            BLOCK_J,
            BLOCK_F,
            STAGES,
            PDL,
        )
    else:
        per_row = tl.num_programs(1)
        items = tl.num_programs(0) * per_row
        item = _first_item(QUEUE, items, RESERVED_SMS, EMULATED_SMS)
        while item < items:
            claimed = tl.atomic_add(QUEUE, 1)  # the next, while this one runs
            _memory_forward_program(
                item // per_row,
                item % per_row,
                item >> 31,
                Y,
                stride_y,
                HID,
                stride_hid,
                SS,
                KCUR,
                GPREV,
                M0,
                s_m0b,
                s_m0h,
                s_m0k,
                KH,
                s_khb,
                s_khh,
                s_khc,
                UH,
                s_uhb,
                s_uhh,
                s_uhc,
                GH,
                s_ghb,
                s_ghh,
                A,
                tau,
                H,
                DK,
                DV,
                F,
                HV,
                COL_KEY,
                COL_VALUE,
                COL_BETA,
                COL_DECAY,
                COL_QUERY,
                COL_RGATE,
                COL_FFN,
                WRITE,
                MEMORY,
                BLOCK_DK,
                BLOCK_DV,
                BLOCK_R,
                BLOCK_J,
                BLOCK_F,
                STAGES,
                False,
            )
            item = claimed
        _release_dependents(PDL)


@triton.jit
def _split_summed(P, split_stride, offsets, ok, SPLITS: tl.constexpr):
    """The values at `offsets` of a split GEMM's output: its SPLITS partial products summed
    as `linear_reduce_kernel` sums them (`_splits_sum`); with one split, P holds the output
    itself."""
    if SPLITS > 1:
        acc = _splits_sum(P, split_stride, offsets, ok, 0, SPLITS)
    else:
        acc = tl.load(P + offsets, mask=ok, other=0.0)
    return acc


@triton.jit
def rev_row_kernel(
    DN,
    DN_SPLIT_STRIDE,  # DN_SPLITS > 1: DN holds the dn GEMM's partials, this many elements apart
    N_,
    X,
    stride_row: tl.int64,  # the RMSNorm backward's dn, n and x rows (B, D), one stride
    BASE,
    stride_base: tl.int64,  # BASE_GROUND: dP[:, t]; else dc_in (B, D)
    GATE,
    DG,  # BASE_GROUND: dc = dP + gate * dg + ...
    EXTRA,  # HAS_EXTRA: added to dc (ds_prev at the chunk's end)
    # THEN_LAYER: start layer i's backward at this step
    DZ,
    PG,
    stride_pg: tl.int64,
    CIN,
    DPG,
    stride_dpg: tl.int64,
    DCIN,
    # THEN_STEP: the step's end (dg = dc), and the ground of the step before (HAS_PREV)
    DFUSE_PREV,
    stride_df: tl.int64,
    P_PREV,
    GATE_PREV,
    DYFG_PREV,
    D,
    eps,
    BASE_GROUND: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    THEN_LAYER: tl.constexpr,
    HAS_PREV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DN_SPLITS: tl.constexpr,
    WHOLE_ROW: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """dc = base + rms_back(n, x, dn) (+ extra); then layer start (dZ = dc, the predict
    gate's input gradient, dc_in = dc * sigmoid(pg)) or step end (dg = dc; d_fuse and the
    fuse gate's input gradient of the previous step). Grid (B,). Dense (B, D) buffers share
    `stride_row` = D unless given their own stride. dn is the output of a split-K GEMM
    summed here (DN_SPLITS > 1), in its sum kernel's order: one launch fewer a GEMM."""
    _await_predecessor(PDL)
    b = tl.program_id(0)
    row = b * stride_row
    acc_t = DN.dtype.element_ty
    if WHOLE_ROW:
        # D <= BLOCK_D: every load of the row issued at once, before the sums (the second
        # pass's loads after them, and after its first store, were two more round trips)
        rd = tl.arange(0, BLOCK_D)
        ok = rd < D
        x = tl.load(X + row + rd, mask=ok, other=0.0)
        dn = _split_summed(DN, DN_SPLIT_STRIDE, row + rd, ok, DN_SPLITS)
        n = tl.load(N_ + row + rd, mask=ok, other=0.0)
        rest, pg, c_in, p, g = _rev_row_inputs(
            b, row, rd, ok, BASE, stride_base, GATE, DG, EXTRA, PG, stride_pg, CIN, P_PREV,
            GATE_PREV, BASE_GROUND, HAS_EXTRA, THEN_LAYER, HAS_PREV,
        )  # fmt: skip
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        mean_dn = tl.sum(dn * n, axis=0) / D
        _release_dependents(PDL)  # only the stores are left
        dc = r * (dn - n * mean_dn) + rest
        _rev_row_outputs(
            b, row, rd, ok, dc, pg, c_in, p, g, DZ, DPG, stride_dpg, DCIN, DG, DFUSE_PREV,
            stride_df, DYFG_PREV, THEN_LAYER, HAS_PREV,
        )  # fmt: skip
    else:
        sx = tl.sum(tl.zeros((BLOCK_D,), dtype=acc_t), axis=0)
        sdn = tl.sum(tl.zeros((BLOCK_D,), dtype=acc_t), axis=0)
        for d0 in range(0, D, BLOCK_D):
            rd = d0 + tl.arange(0, BLOCK_D)
            ok = rd < D
            x = tl.load(X + row + rd, mask=ok, other=0.0)
            sx += tl.sum(x * x, axis=0)
            dn = _split_summed(DN, DN_SPLIT_STRIDE, row + rd, ok, DN_SPLITS)
            sdn += tl.sum(dn * tl.load(N_ + row + rd, mask=ok, other=0.0), axis=0)
        r = 1.0 / tl.sqrt(sx / D + eps)
        mean_dn = sdn / D
        _release_dependents(PDL)  # the second pass is what is left
        for d0 in range(0, D, BLOCK_D):
            rd = d0 + tl.arange(0, BLOCK_D)
            ok = rd < D
            dn = _split_summed(DN, DN_SPLIT_STRIDE, row + rd, ok, DN_SPLITS)
            n = tl.load(N_ + row + rd, mask=ok, other=0.0)
            rest, pg, c_in, p, g = _rev_row_inputs(
                b, row, rd, ok, BASE, stride_base, GATE, DG, EXTRA, PG, stride_pg, CIN,
                P_PREV, GATE_PREV, BASE_GROUND, HAS_EXTRA, THEN_LAYER, HAS_PREV,
            )  # fmt: skip
            dc = r * (dn - n * mean_dn) + rest
            _rev_row_outputs(
                b, row, rd, ok, dc, pg, c_in, p, g, DZ, DPG, stride_dpg, DCIN, DG, DFUSE_PREV,
                stride_df, DYFG_PREV, THEN_LAYER, HAS_PREV,
            )  # fmt: skip


@triton.jit
def _rev_row_inputs(
    b, row, rd, ok, BASE, stride_base, GATE, DG, EXTRA, PG, stride_pg, CIN, P_PREV, GATE_PREV,
    BASE_GROUND: tl.constexpr, HAS_EXTRA: tl.constexpr, THEN_LAYER: tl.constexpr,
    HAS_PREV: tl.constexpr,
):  # fmt: skip
    """What `rev_row_kernel` reads of a block of the row besides the norm's rows: the terms
    of dc that need no sum (base, the ground's gate * dg, the extra term: one tensor held
    over the sums, not four), and what the layer start (pg, c_in) or the step's end (the
    previous step's p and gate) needs (zeros otherwise)."""
    zero = tl.zeros(rd.shape, dtype=DG.dtype.element_ty)
    rest = tl.load(BASE + b * stride_base + rd, mask=ok, other=0.0)
    pg, c_in, p, g = zero, zero, zero, zero
    if BASE_GROUND:
        rest += tl.load(GATE + row + rd, mask=ok, other=0.0) * tl.load(
            DG + row + rd, mask=ok, other=0.0
        )
    if HAS_EXTRA:
        rest += tl.load(EXTRA + row + rd, mask=ok, other=0.0)
    if THEN_LAYER:
        pg = tl.load(PG + b * stride_pg + rd, mask=ok, other=0.0)
        c_in = tl.load(CIN + row + rd, mask=ok, other=0.0)
    elif HAS_PREV:
        p = tl.load(P_PREV + row + rd, mask=ok, other=0.0)
        g = tl.load(GATE_PREV + row + rd, mask=ok, other=0.0)
    return rest, pg, c_in, p, g


@triton.jit
def _rev_row_outputs(
    b, row, rd, ok, dc, pg, c_in, p, g, DZ, DPG, stride_dpg, DCIN, DG, DFUSE_PREV, stride_df,
    DYFG_PREV, THEN_LAYER: tl.constexpr, HAS_PREV: tl.constexpr,
):  # fmt: skip
    """What `rev_row_kernel` writes of a block of the row from its dc: the layer start's dZ,
    the predict gate's input gradient and dc_in, or the step end's dg and the previous
    step's d_fuse and fuse-gate input gradient."""
    if THEN_LAYER:
        tl.store(DZ + row + rd, dc, mask=ok)
        sg = _sigmoid(pg)
        tl.store(DPG + b * stride_dpg + rd, dc * c_in * sg * (1.0 - sg), mask=ok)
        tl.store(DCIN + row + rd, dc * sg, mask=ok)
    else:
        tl.store(DG + row + rd, dc, mask=ok)
        if HAS_PREV:
            tl.store(DFUSE_PREV + b * stride_df + rd, dc, mask=ok)
            tl.store(DYFG_PREV + row + rd, dc * p * g * (1.0 - g), mask=ok)


@triton.jit
def rev_start_kernel(
    DS_END,
    DG,
    DFUSE,
    stride_df: tl.int64,
    P,
    GATE,
    DYFG,
    D,
    HAS_DS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The chunk's last step: dg = ds_end (or 0), d_fuse and the fuse gate's input gradient."""
    _await_predecessor(PDL)
    _release_dependents(PDL)
    b = tl.program_id(0)
    for d0 in range(0, D, BLOCK_D):
        rd = d0 + tl.arange(0, BLOCK_D)
        ok = rd < D
        row = b * D + rd
        if HAS_DS:
            dg = tl.load(DS_END + row, mask=ok, other=0.0)
        else:
            dg = tl.zeros((BLOCK_D,), dtype=DG.dtype.element_ty)
        tl.store(DG + row, dg, mask=ok)
        tl.store(DFUSE + b * stride_df + rd, dg, mask=ok)
        p = tl.load(P + row, mask=ok, other=0.0)
        g = tl.load(GATE + row, mask=ok, other=0.0)
        tl.store(DYFG + row, dg * p * g * (1.0 - g), mask=ok)


# ------------------------------------------------------------------ memory, reverse
@triton.jit
def _memory_backward_program(
    b,
    h,
    zero,
    Y,
    stride_y: tl.int64,  # (B, width) the layer's input-GEMM output at this step
    DY,
    stride_dy: tl.int64,  # (B, width) its gradient at this step (filled here)
    DY_PREV,  # WRITE: the gradient row of the step before (its key columns)
    DH,
    stride_dh: tl.int64,  # (B, H*DV + F) gradient of the down-projection's input
    RO,
    stride_o: tl.int64,  # (B, H*DV) the read output's RMSNorm
    QA,
    s_qb: tl.int64,
    s_qh,
    s_qc,  # (B, H, C, DK) the chunk's read queries
    RQ,
    s_rqb: tl.int64,
    s_rqh,  # (B, H, DV) M0^T q
    DRQ,
    s_drqb: tl.int64,
    s_drqh,  # (B, H, DV) out: its gradient
    KA,
    s_kb: tl.int64,
    s_kh,
    s_kc,  # (B, H, C, DK) the chunk's keys
    UA,
    s_ub: tl.int64,
    s_uh,
    s_uc,  # (B, H, C, DV) the chunk's errors
    GA,
    s_gb: tl.int64,
    s_gh,
    s_gc,  # (B, H, C) cumulative log-decays
    DKA,
    s_dkb: tl.int64,
    s_dkh,
    s_dkc,  # (B, H, C, DK) adjoints, added to
    DUA,
    s_dub: tl.int64,
    s_duh,
    s_duc,  # (B, H, C, DV)
    DGA,
    s_dgb: tl.int64,
    s_dgh,
    s_dgc,  # (B, H, C)
    M0,
    s_m0b: tl.int64,
    s_m0h,
    s_m0k,  # (B, H, DK, DV)
    QK,
    s_qkb: tl.int64,
    s_qkh,
    s_qkc,  # (B, H, C, C) the chunk's Gram rows q_t . k_j (`chunk_gram`)
    # WRITE only (layer 0): this step's write activations and outputs
    KPRE,
    stride_kpre: tl.int64,  # (B, H*DK) pre-activation of k_t
    V,
    s_vb: tl.int64,
    s_vh,  # (B, H, DV)
    BETA,
    s_bb: tl.int64,
    s_bh,  # (B, H)
    PRED,
    s_pb: tl.int64,
    s_ph,  # (B, H, DV) M_{t-1}^T k_t
    RK,
    s_rkb: tl.int64,
    s_rkh,  # (B, H, DV) M0^T k_t
    DRK,
    s_drkb: tl.int64,
    s_drkh,  # (B, H, DV) out
    DGS,  # (B, H) running suffix sum of dG (d log a)
    DA_ROWS,  # (B, H) dA accumulated per row
    DKPRE0,  # (B, H*DK) out at t = 0: gradient of k_0's pre-activation
    KK,
    s_kkb: tl.int64,
    s_kkh,
    s_kkc,  # (B, H, C, C) the chunk's Gram rows k_t . k_j
    A,
    SUMS,  # (B, 2) the read norm's row sums (`read_norm_sums_kernel`; under tp, the group's)
    DOB,  # (B, H, BLOCK_S, DV) the block's do (the read's output gradient), by step
    DPB,  # WRITE: (B, H, BLOCK_S, DV) the block's dpred (the write's prediction gradient)
    tau,
    is_last,
    eps,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    F: tl.constexpr,
    HV: tl.constexpr,
    COL_KEY: tl.constexpr,
    COL_VALUE: tl.constexpr,
    COL_BETA: tl.constexpr,
    COL_DECAY: tl.constexpr,
    COL_QUERY: tl.constexpr,
    COL_RGATE: tl.constexpr,
    COL_FFN: tl.constexpr,
    WRITE: tl.constexpr,
    MEMORY: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DVW: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_F: tl.constexpr,
    NORM_WIDTH: tl.constexpr,
    BLOCK_S: tl.constexpr,
    STAGES: tl.constexpr,
    RELEASE: tl.constexpr,
):
    """One (row, head or FFN block) item of `memory_backward_kernel`; RELEASE: it lets the
    next kernel launch once its own loop is done (plain grids). `zero` is 0: a literal for a
    plain grid (its code is unchanged), and in the item queue's loop a value the compiler
    cannot see is 0, added to tau and to every index vector (`_indices`) so that what they
    give is computed per item, not once before the loop and held across it."""
    tau = tau + zero
    y_row = Y + b * stride_y
    dy_row = DY + b * stride_dy
    if h >= H:
        rf = (h - H) * BLOCK_F + _indices(zero, BLOCK_F)
        f_ok = rf < F
        fa = tl.load(y_row + COL_FFN + rf, mask=f_ok, other=0.0)
        fb = tl.load(y_row + COL_FFN + F + rf, mask=f_ok, other=0.0)
        dh = tl.load(DH + b * stride_dh + HV + rf, mask=f_ok, other=0.0)
        tl.store(dy_row + COL_FFN + rf, _silu_back(fa, dh * fb), mask=f_ok)
        tl.store(dy_row + COL_FFN + F + rf, dh * _silu(fa), mask=f_ok)
    elif MEMORY:
        acc_t = DY.dtype.element_ty
        # The read's RMSNorm spans all heads: its row sums over the NORM_WIDTH = tp * HV
        # values, summed once per row before this launch (`read_norm_sums_kernel`).
        sx = tl.load(SUMS + b * 2)
        sdn = tl.load(SUMS + b * 2 + 1)
        r = 1.0 / tl.sqrt(sx / NORM_WIDTH + eps)
        mean_dn = sdn / NORM_WIDTH
        rk = _indices(zero, BLOCK_DK)
        k_ok = (rk < DK) | (DK == BLOCK_DK)  # constant where whole (no mask in the loop)
        rc = _indices(zero, BLOCK_C)
        read_ok = rc <= tau
        is_t = rc == tau
        b0 = tau - tau % BLOCK_S  # the block's first step
        slot = tau - b0
        in_block = read_ok & (rc >= b0)  # the rows pushed into at once
        # o = e^{G_t} M0^T q + sum_{j<=t} e^{G_t - G_j} (q.k_j) u_j; the write's prediction
        # pred = e^{G_{t-1}} M0^T k_t + sum_{j<t} e^{G_{t-1} - G_j} (k_t.k_j) u_j.
        # The value columns' own adjoints first, over all of d_value at once; then one pass
        # over the blocks of M0, of the history's u_j and of their adjoints; what needs the
        # sums over d_value (the k_j, G_j and query adjoints) follows the loop.
        g_base = GA + b * s_gb + h * s_gh
        Gt = tl.load(g_base + tau * s_gc)
        eG = tl.exp(Gt)
        Gj = tl.load(g_base + rc * s_gc, mask=read_ok, other=0.0)
        w = tl.where(read_ok, tl.exp(Gt - Gj), 0.0)
        k_base = KA + b * s_kb + h * s_kh
        sdot = tl.load(QK + b * s_qkb + h * s_qkh + tau * s_qkc + rc, mask=read_ok, other=0.0)
        coef = w * sdot  # dU_j += coef_j * do
        if WRITE:
            has_prev = tau > 0
            Gp = tl.load(g_base + (tau - 1) * s_gc, mask=has_prev, other=0.0)
            eGp = tl.exp(Gp)
            write_ok = rc < tau
            w2 = tl.where(write_ok, tl.exp(Gp - Gj), 0.0)
            kk_row = KK + b * s_kkb + h * s_kkh + tau * s_kkc
            sdot2 = tl.load(kk_row + rc, mask=write_ok, other=0.0)
            coef2 = w2 * sdot2
            beta = tl.load(BETA + b * s_bb + h * s_bh)
            # the read's coefficient at row t (weight 1: q_t . k_t): du_t's share, taken once
            coef_t = tl.sum(tl.where(is_t, coef, 0.0), axis=0)
        u_base = UA + b * s_ub + h * s_uh
        du_base = DUA + b * s_dub + h * s_duh
        m0_base = M0 + b * s_m0b + h * s_m0h
        kept = (b.to(tl.int64) * H + h) * BLOCK_S * DV  # this head's block of do / dpred
        # The step's value-column adjoints over all of d_value at once (a value or two per
        # thread): do, the write's dpred, and what they give (the gate's, value's and beta's
        # columns of DY, dG_t's and dG_{t-1}'s own terms). Inside the loop below, whose
        # (rows, BLOCK_DV) tiles lay a column's values across the rows' threads, each of
        # these was computed by every thread of a row (32 times over).
        rw = _indices(zero, BLOCK_DVW)
        w_ok = rw < DV
        col_w = h * DV + rw
        dh_read = tl.load(DH + b * stride_dh + col_w, mask=w_ok, other=0.0)
        rg = tl.load(y_row + COL_RGATE + col_w, mask=w_ok, other=0.0)
        ro = tl.load(RO + b * stride_o + col_w, mask=w_ok, other=0.0)
        rq = tl.load(RQ + b * s_rqb + h * s_rqh + rw, mask=w_ok, other=0.0)
        if WRITE:
            du_t = tl.load(du_base + tau * s_duc + rw, mask=w_ok, other=0.0)
            v = tl.load(V + b * s_vb + h * s_vh + rw, mask=w_ok, other=0.0)
            pred = tl.load(PRED + b * s_pb + h * s_ph + rw, mask=w_ok, other=0.0)
            rk_t = tl.load(RK + b * s_rkb + h * s_rkh + rw, mask=w_ok, other=0.0)
        do = tl.where(w_ok, r * (dh_read * _silu(rg) - ro * mean_dn), 0.0)
        dGt = eG * tl.sum(do * rq, axis=0)
        tl.store(dy_row + COL_RGATE + col_w, _silu_back(rg, dh_read * ro), mask=w_ok)
        tl.store(DOB + kept + slot * DV + rw, do, mask=w_ok)
        tl.store(DRQ + b * s_drqb + h * s_drqh + rw, eG * do, mask=w_ok)
        if WRITE:
            # u_t = beta (v - M_{t-1}^T k_t): its adjoint du is complete once the read at
            # t has added its share (j = t: weight 1).
            du = du_t + coef_t * do
            dvv = beta * du
            dGp = -eGp * tl.sum(dvv * rk_t, axis=0)
            tl.store(dy_row + COL_BETA + h, tl.sum(du * (v - pred), axis=0) * beta * (1.0 - beta))
            tl.store(dy_row + COL_VALUE + col_w, dvv, mask=w_ok)
            tl.store(DPB + kept + slot * DV + rw, -dvv, mask=w_ok)
            tl.store(DRK + b * s_drkb + h * s_drkh + rw, -eGp * dvv, mask=w_ok)
        # The loop reads do and dpred back by blocks (L1/L2 hits): every thread's stores
        # above visible to the whole program first.
        tl.debug_barrier()
        # Over d_value in BLOCK_DV blocks, one pass over the blocks of M0, of the history's
        # u_j and of their adjoints. The products summed over d_value (M0 drq, M0 drk, the
        # u_j's with do and dpred) are accumulated elementwise and summed over the columns
        # once, after the loop (a sum over the block's columns every block was shuffles).
        acc_dq = tl.zeros((BLOCK_DK, BLOCK_DV), dtype=acc_t)
        acc_dsd = tl.zeros((BLOCK_C, BLOCK_DV), dtype=acc_t)
        if WRITE:
            acc_dk = tl.zeros((BLOCK_DK, BLOCK_DV), dtype=acc_t)
            acc_dsd2 = tl.zeros((BLOCK_C, BLOCK_DV), dtype=acc_t)
        for v0 in tl.range(0, DV, BLOCK_DV, num_stages=STAGES):
            rv = v0 + _indices(zero, BLOCK_DV)
            v_ok = (rv < DV) | (DV % BLOCK_DV == 0)  # constant where whole blocks
            ok_v = read_ok[:, None] & v_ok[None, :]
            # The block's rows of the chunk's u adjoints (the rest: the block's flush).
            tile_du = du_base + rc[:, None] * s_duc + rv[None, :]
            ok_push = in_block[:, None] & v_ok[None, :]
            # Every load of the block before its first store: a store holds back every later
            # load (the pointers may alias), so loads after stores cost round trips of their own.
            do_b = tl.load(DOB + kept + slot * DV + rv, mask=v_ok, other=0.0)
            Uh = tl.load(u_base + rc[:, None] * s_uc + rv[None, :], mask=ok_v, other=0.0)
            m0 = tl.load(
                m0_base + rk[:, None] * s_m0k + rv[None, :],
                mask=k_ok[:, None] & v_ok[None, :],
                other=0.0,
            )
            du_rows = tl.load(tile_du, mask=ok_push, other=0.0)
            if WRITE:
                dp_b = tl.load(DPB + kept + slot * DV + rv, mask=v_ok, other=0.0)
            acc_dsd += Uh * do_b[None, :]
            acc_dq += m0 * do_b[None, :]
            du_rows += coef[:, None] * do_b[None, :]
            if WRITE:
                acc_dsd2 += Uh * dp_b[None, :]
                acc_dk += m0 * dp_b[None, :]
                du_rows += coef2[:, None] * dp_b[None, :]
            tl.store(tile_du, du_rows, mask=ok_push)
        _release_dependents(RELEASE)  # (the FFN programs release when they end)
        dsd = tl.sum(acc_dsd, axis=1)  # sum_v u_j * do, then times w_j
        dq = eG * tl.sum(acc_dq, axis=1)  # M0 drq (drq = e^{G_t} do)
        if WRITE:
            dsd2 = tl.sum(acc_dsd2, axis=1)
            dk = eGp * tl.sum(acc_dk, axis=1)  # M0 drk (drk = e^{G_{t-1}} dpred)
        # q_t and k_t are only needed from here (their products with the keys are the Gram
        # rows): read with the keys, not held over the loop; so are the keys themselves
        # (held over the loop they would take the registers its pipelined tiles need).
        q = tl.load(QA + b * s_qb + h * s_qh + tau * s_qc + rk, mask=k_ok, other=0.0)
        Kh = tl.load(
            k_base + rc[:, None] * s_kc + rk[None, :],
            mask=read_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        dsd = dsd * w
        dw = dsd * sdot
        dG_add = tl.where(is_t, dGt + tl.sum(dw, axis=0), 0.0) - dw
        dq += tl.sum(dsd[:, None] * Kh, axis=0)
        if WRITE:
            k = tl.load(k_base + tau * s_kc + rk, mask=k_ok, other=0.0)
            dsd2 = dsd2 * w2
            dw2 = dsd2 * sdot2
            at_prev = dGp + tl.sum(dw2, axis=0)  # G_{t-1}'s own term (its row may precede b0)
            dG_add += tl.where(rc == tau - 1, at_prev, 0.0) - dw2
            dk += tl.sum(dsd2[:, None] * Kh, axis=0)
        # Everything the rest reads, issued before its first store (a store holds back every
        # later load: one round trip each otherwise). The block's rows of the chunk's k and G
        # adjoints are each read and written once; the k adjoint's as a (BLOCK_S, DK) tile
        # of the rows [b0, b0 + BLOCK_S), not (C, DK): the whole-chunk tile held the
        # kernel's register peak.
        q_pre = tl.load(y_row + COL_QUERY + h * DK + rk, mask=k_ok, other=0.0)
        rb = b0 + _indices(zero, BLOCK_S)
        tile_dk = DKA + b * s_dkb + h * s_dkh + rb[:, None] * s_dkc + rk[None, :]
        ok_push_k = (rb <= tau)[:, None] & k_ok[None, :]
        dK_new = tl.load(tile_dk, mask=ok_push_k, other=0.0)
        dg_ptr = DGA + b * s_dgb + h * s_dgh
        dG_new = tl.load(dg_ptr + rc * s_dgc, mask=in_block, other=0.0) + dG_add
        if WRITE:
            # row t - 1 is the previous block's when t opens a block: its own term added here
            prev = dg_ptr + (tau - 1) * s_dgc
            at_block_start = (slot == 0) & (tau > 0)
            dG_prev = tl.load(prev, mask=at_block_start, other=0.0)
            dgs = tl.load(DGS + b * H + h)
            decay_pre = tl.load(y_row + COL_DECAY + h)
            a_h = tl.load(A + h)
            da_row = tl.load(DA_ROWS + b * H + h)
            k_pre = tl.load(KPRE + b * stride_kpre + h * DK + rk, mask=k_ok, other=0.0)
        # Row b0 + s of a C-vector is picked out exactly (one term, the others zero).
        pick = rc[None, :] == rb[:, None]
        dK_new += tl.sum(tl.where(pick, dsd[None, :], 0.0), axis=1)[:, None] * q[None, :]
        if WRITE:
            dsd2_b = tl.sum(tl.where(pick, dsd2[None, :], 0.0), axis=1)
            dK_new += dsd2_b[:, None] * k[None, :]
            dK_new += tl.where((rb == tau)[:, None], dk[None, :], 0.0)
        tl.store(tile_dk, dK_new, mask=ok_push_k)
        tl.store(dg_ptr + rc * s_dgc, dG_new, mask=in_block)
        if WRITE:
            tl.store(prev, dG_prev + at_prev, mask=at_block_start)
        tl.store(dy_row + COL_QUERY + h * DK + rk, _l2n_relu_back(q_pre, dq), mask=k_ok)
        if WRITE:
            # G_t = G_{t-1} + log a_t: d log a_t is the suffix sum of dG (complete at t now).
            dgs += tl.sum(tl.where(is_t, dG_new, 0.0), axis=0)
            tl.store(DGS + b * H + h, dgs)
            tl.store(dy_row + COL_DECAY + h, dgs * (-a_h) * _sigmoid(decay_pre))
            tl.store(DA_ROWS + b * H + h, da_row - dgs * _softplus(decay_pre))
            # k_t came from step t-1's key columns (or, at t = 0, from s_prev).
            dk_t = tl.sum(tl.where((rb == tau)[:, None], dK_new, 0.0), axis=0)
            dk_pre = _l2n_relu_back(k_pre, dk_t)
            if is_last != 0:
                tl.store(
                    dy_row + COL_KEY + h * DK + rk, tl.zeros((BLOCK_DK,), dtype=acc_t), mask=k_ok
                )
            if tau > 0:
                tl.store(DY_PREV + b * stride_dy + COL_KEY + h * DK + rk, dk_pre, mask=k_ok)
            else:
                tl.store(DKPRE0 + b * H * DK + h * DK + rk, dk_pre, mask=k_ok)


def queued_item(program: triton.JITFunction, version: tuple[int, int]) -> triton.JITFunction:
    """A memory program as the item queue's loop calls it: `program`, or under a Triton
    before 3.8 (3.6: the GPU image's) a copy of it called apart (noinline). 3.6 computes the
    lanes of the item's index vectors once, before the loop, whatever `zero` adds to them,
    and holds them across it: 48 B a thread of spills in the memory backward at 128
    registers (130M, sm_90; 44 B at 1B under tp 8). Called apart, its values stay per item:
    no spills, one CALL an item. 3.8 inlines it without spills, and inlined it prices faster
    (accounting, 130M, B = 128, H200, the memory backward a step: under 3.8 0.3597 s inlined
    against 0.3665 apart; under 3.6 0.3698 apart against 0.3799 inlined)."""
    if version >= (3, 8):
        return program
    return triton.jit(noinline=True)(program.fn)


_memory_backward_item = queued_item(_memory_backward_program, triton_version())


@triton.jit(do_not_specialize=["tau", "is_last"])
def memory_backward_kernel(
    Y,
    stride_y: tl.int64,  # (B, width) the layer's input-GEMM output at this step
    DY,
    stride_dy: tl.int64,  # (B, width) its gradient at this step (filled here)
    DY_PREV,  # WRITE: the gradient row of the step before (its key columns)
    DH,
    stride_dh: tl.int64,  # (B, H*DV + F) gradient of the down-projection's input
    RO,
    stride_o: tl.int64,  # (B, H*DV) the read output's RMSNorm
    QA,
    s_qb: tl.int64,
    s_qh,
    s_qc,  # (B, H, C, DK) the chunk's read queries
    RQ,
    s_rqb: tl.int64,
    s_rqh,  # (B, H, DV) M0^T q
    DRQ,
    s_drqb: tl.int64,
    s_drqh,  # (B, H, DV) out: its gradient
    KA,
    s_kb: tl.int64,
    s_kh,
    s_kc,  # (B, H, C, DK) the chunk's keys
    UA,
    s_ub: tl.int64,
    s_uh,
    s_uc,  # (B, H, C, DV) the chunk's errors
    GA,
    s_gb: tl.int64,
    s_gh,
    s_gc,  # (B, H, C) cumulative log-decays
    DKA,
    s_dkb: tl.int64,
    s_dkh,
    s_dkc,  # (B, H, C, DK) adjoints, added to
    DUA,
    s_dub: tl.int64,
    s_duh,
    s_duc,  # (B, H, C, DV)
    DGA,
    s_dgb: tl.int64,
    s_dgh,
    s_dgc,  # (B, H, C)
    M0,
    s_m0b: tl.int64,
    s_m0h,
    s_m0k,  # (B, H, DK, DV)
    QK,
    s_qkb: tl.int64,
    s_qkh,
    s_qkc,  # (B, H, C, C) the chunk's Gram rows q_t . k_j (`chunk_gram`)
    # WRITE only (layer 0): this step's write activations and outputs
    KPRE,
    stride_kpre: tl.int64,  # (B, H*DK) pre-activation of k_t
    V,
    s_vb: tl.int64,
    s_vh,  # (B, H, DV)
    BETA,
    s_bb: tl.int64,
    s_bh,  # (B, H)
    PRED,
    s_pb: tl.int64,
    s_ph,  # (B, H, DV) M_{t-1}^T k_t
    RK,
    s_rkb: tl.int64,
    s_rkh,  # (B, H, DV) M0^T k_t
    DRK,
    s_drkb: tl.int64,
    s_drkh,  # (B, H, DV) out
    DGS,  # (B, H) running suffix sum of dG (d log a)
    DA_ROWS,  # (B, H) dA accumulated per row
    DKPRE0,  # (B, H*DK) out at t = 0: gradient of k_0's pre-activation
    KK,
    s_kkb: tl.int64,
    s_kkh,
    s_kkc,  # (B, H, C, C) the chunk's Gram rows k_t . k_j
    A,
    SUMS,  # (B, 2) the read norm's row sums (`read_norm_sums_kernel`; under tp, the group's)
    DOB,  # (B, H, BLOCK_S, DV) the block's do (the read's output gradient), by step
    DPB,  # WRITE: (B, H, BLOCK_S, DV) the block's dpred (the write's prediction gradient)
    QUEUE,  # RESERVED_SMS > 0: this launch's item counter (`QUEUE_STRIDE`), zero
    tau,
    is_last,
    eps,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    F: tl.constexpr,
    HV: tl.constexpr,
    COL_KEY: tl.constexpr,
    COL_VALUE: tl.constexpr,
    COL_BETA: tl.constexpr,
    COL_DECAY: tl.constexpr,
    COL_QUERY: tl.constexpr,
    COL_RGATE: tl.constexpr,
    COL_FFN: tl.constexpr,
    WRITE: tl.constexpr,
    MEMORY: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DVW: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_F: tl.constexpr,
    NORM_WIDTH: tl.constexpr,
    BLOCK_S: tl.constexpr,
    STAGES: tl.constexpr,
    RESERVED_SMS: tl.constexpr = 0,
    EMULATED_SMS: tl.constexpr = 0,  # the interpreter's stand-in for %smid (`_sm_id`)
    PDL: tl.constexpr = False,
):
    """Grid (B, H + ceil(F / BLOCK_F)): the reverse of `memory_forward_kernel` at one step.
    A head program first forms the step's value-column adjoints (do, dpred and their
    terms) over all BLOCK_DVW value columns at once, stores them, and then walks M0, the
    history's u_j and their adjoints over d_value in BLOCK_DV blocks, reading do and dpred
    back (a whole head's M0 and history tiles in registers at once spilled most of the
    kernel at dk 128 / dv 256: accounting/gpu_compile.py). Head programs fill the read's
    (and at layer 0 the write's) columns of DY and add to the chunk's dK, dU, dG; FFN
    programs fill the FFN columns.

    The history's adjoints are pushed at once only into the rows of the current block of
    BLOCK_S steps [b0, t] (the rows this and the block's earlier-processed steps still
    read: du_t, dk_t and dG_t must be complete at step t); what a step adds to the rows
    before its block is deferred: the step keeps its do (and dpred), and after the block's
    first step b0 one flush (`memory_backward_flush_kernel`) adds the whole block's share
    to rows j < b0, its coefficients recomputed from the Gram matrices and decays.
    Per step the chunk's dK, dU, dG are then read and written over at most BLOCK_S rows, not
    all t + 1 (the pushes were ~2/3 of the kernel's history traffic).

    The d_value loop is software-pipelined (STAGES): the next blocks' tiles are copied into
    shared memory (cp.async) while this block computes, instead of one dependent round trip
    per block. Its registers come from the products q_t . k_j and k_t . k_j, read as rows of
    the chunk's Gram matrices (`chunk_gram`, one batched matmul before the sweep) rather than
    reduced here from the (C, DK) key tile, and from the k adjoint's update over the block's
    BLOCK_S rows rather than all C (the two held the kernel at 255 registers; now 128).
    No later block reads what an earlier block stores (other columns, or Y not DY), so the
    pipeliner may issue the loads ahead of the stores; what the loop reads of the value
    adjoints was stored before it, behind a barrier of the whole program.

    RESERVED_SMS > 0 (engine.side_work_sm_share): the programs that land on the first
    RESERVED_SMS SMs leave at once, so that the side stream's recompute and weight gradients
    have whole SMs (a smaller grid would just be spread over all of them), and the others
    take the grid's items from a counter (`_first_item`) until it runs out, each claiming the
    next while it runs its current one. Each item is computed as its own program would be:
    the results are bit-identical. The item body adds `zero` (0, from the item, which the
    compiler cannot see is 0) to its index vectors and tau: else the compiler computes what
    does not change from item to item once, before the loop, and holds it across the loop
    (296 B of spills at 128 registers; now none, 4 programs per SM as the plain grid)."""
    _await_predecessor(PDL)
    if RESERVED_SMS == 0:
        _memory_backward_program(
            tl.program_id(0),
            tl.program_id(1),
            0,
            Y,
            stride_y,
            DY,
            stride_dy,
            DY_PREV,
            DH,
            stride_dh,
            RO,
            stride_o,
            QA,
            s_qb,
            s_qh,
            s_qc,
            RQ,
            s_rqb,
            s_rqh,
            DRQ,
            s_drqb,
            s_drqh,
            KA,
            s_kb,
            s_kh,
            s_kc,
            UA,
            s_ub,
            s_uh,
            s_uc,
            GA,
            s_gb,
            s_gh,
            s_gc,
            DKA,
            s_dkb,
            s_dkh,
            s_dkc,
            DUA,
            s_dub,
            s_duh,
            s_duc,
            DGA,
            s_dgb,
            s_dgh,
            s_dgc,
            M0,
            s_m0b,
            s_m0h,
            s_m0k,
            QK,
            s_qkb,
            s_qkh,
            s_qkc,
            KPRE,
            stride_kpre,
            V,
            s_vb,
            s_vh,
            BETA,
            s_bb,
            s_bh,
            PRED,
            s_pb,
            s_ph,
            RK,
            s_rkb,
            s_rkh,
            DRK,
            s_drkb,
            s_drkh,
            DGS,
            DA_ROWS,
            DKPRE0,
            KK,
            s_kkb,
            s_kkh,
            s_kkc,
            A,
            SUMS,
            DOB,
            DPB,
            tau,
            is_last,
            eps,
            H,
            DK,
            DV,
            F,
            HV,
            COL_KEY,
            COL_VALUE,
            COL_BETA,
            COL_DECAY,
            COL_QUERY,
            COL_RGATE,
            COL_FFN,
            WRITE,
            MEMORY,
            BLOCK_DK,
            BLOCK_DV,
            BLOCK_DVW,
            BLOCK_C,
            BLOCK_F,
            NORM_WIDTH,
            BLOCK_S,
            STAGES,
            PDL,
        )
    else:
        per_row = tl.num_programs(1)
        items = tl.num_programs(0) * per_row
        item = _first_item(QUEUE, items, RESERVED_SMS, EMULATED_SMS)
        while item < items:
            claimed = tl.atomic_add(QUEUE, 1)  # the next, while this one runs
            _memory_backward_item(
                item // per_row,
                item % per_row,
                item >> 31,  # 0: the item is never negative
                Y,
                stride_y,
                DY,
                stride_dy,
                DY_PREV,
                DH,
                stride_dh,
                RO,
                stride_o,
                QA,
                s_qb,
                s_qh,
                s_qc,
                RQ,
                s_rqb,
                s_rqh,
                DRQ,
                s_drqb,
                s_drqh,
                KA,
                s_kb,
                s_kh,
                s_kc,
                UA,
                s_ub,
                s_uh,
                s_uc,
                GA,
                s_gb,
                s_gh,
                s_gc,
                DKA,
                s_dkb,
                s_dkh,
                s_dkc,
                DUA,
                s_dub,
                s_duh,
                s_duc,
                DGA,
                s_dgb,
                s_dgh,
                s_dgc,
                M0,
                s_m0b,
                s_m0h,
                s_m0k,
                QK,
                s_qkb,
                s_qkh,
                s_qkc,
                KPRE,
                stride_kpre,
                V,
                s_vb,
                s_vh,
                BETA,
                s_bb,
                s_bh,
                PRED,
                s_pb,
                s_ph,
                RK,
                s_rkb,
                s_rkh,
                DRK,
                s_drkb,
                s_drkh,
                DGS,
                DA_ROWS,
                DKPRE0,
                KK,
                s_kkb,
                s_kkh,
                s_kkc,
                A,
                SUMS,
                DOB,
                DPB,
                tau,
                is_last,
                eps,
                H,
                DK,
                DV,
                F,
                HV,
                COL_KEY,
                COL_VALUE,
                COL_BETA,
                COL_DECAY,
                COL_QUERY,
                COL_RGATE,
                COL_FFN,
                WRITE,
                MEMORY,
                BLOCK_DK,
                BLOCK_DV,
                BLOCK_DVW,
                BLOCK_C,
                BLOCK_F,
                NORM_WIDTH,
                BLOCK_S,
                STAGES,
                False,
            )
            item = claimed
        _release_dependents(PDL)


@triton.jit(do_not_specialize=["b0", "n_steps"])
def memory_backward_flush_kernel(
    QA,
    s_qb: tl.int64,
    s_qh,
    s_qc,
    KA,
    s_kb: tl.int64,
    s_kh,
    s_kc,
    UA,
    s_ub: tl.int64,
    s_uh,
    s_uc,
    GA,
    s_gb: tl.int64,
    s_gh,
    s_gc,
    DKA,
    s_dkb: tl.int64,
    s_dkh,
    s_dkc,
    DUA,
    s_dub: tl.int64,
    s_duh,
    s_duc,
    DGA,
    s_dgb: tl.int64,
    s_dgh,
    s_dgc,
    QK,
    s_qkb: tl.int64,
    s_qkh,
    s_qkc,  # (B, H, C, C) the chunk's Gram matrices q_s . k_j and k_s . k_j (`chunk_gram`)
    KK,
    s_kkb: tl.int64,
    s_kkh,
    s_kkc,
    DOB,
    DPB,
    b0,
    n_steps,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    WRITE: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The deferred pushes of the steps [b0, b0 + BLOCK_S) onto the rows j < b0 (see
    `memory_backward_kernel`): with W[j, s] = e^{G_s - G_j} (q_s.k_j) the read's weights
    and W2[j, s] = e^{G_{s-1} - G_j} (k_s.k_j) the write's, over the block's steps s:
    dU_j += W do + W2 dpred; dsd[j, s] = e^{G_s - G_j} (u_j.do_s) (and dsd2 with
    e^{G_{s-1} - G_j} and dpred_s); dK_j += dsd q + dsd2 k; dG_j -= sum_s dsd (q_s.k_j)
    + dsd2 (k_s.k_j), over the block's steps before `n_steps` (the chunk's length); the
    rows in blocks of BLOCK_J (what a program holds at once). The products q_s.k_j and
    k_s.k_j are read from the chunk's Gram matrices (`chunk_gram`), not formed from the
    key tile (which took half the registers). Grid (B, H); launched after the memory
    backward of a block's first step b0 > 0 (its own kernel: inside the step kernel its
    tiles spilled both)."""
    _await_predecessor(PDL)
    # (its stores run to the end; at 2 programs per SM its grid is several waves, and the
    # next kernel launches only once the last wave's programs have all released)
    _release_dependents(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    kept = (b.to(tl.int64) * H + h) * BLOCK_S * DV
    acc_t = DKA.dtype.element_ty
    rs = tl.arange(0, BLOCK_S)
    rk = tl.arange(0, BLOCK_DK)
    k_ok = rk < DK
    steps = b0 + rs
    s_ok = steps < n_steps  # the block's steps that exist (a chunk may end inside a block)
    g_base = GA + b * s_gb + h * s_gh
    k_base = KA + b * s_kb + h * s_kh
    u_base = UA + b * s_ub + h * s_uh
    du_base = DUA + b * s_dub + h * s_duh
    Gs = tl.load(g_base + steps * s_gc, mask=s_ok, other=0.0)
    Qs = tl.load(
        QA + b * s_qb + h * s_qh + steps[:, None] * s_qc + rk[None, :],
        mask=s_ok[:, None] & k_ok[None, :],
        other=0.0,
    )  # (S, DK)
    if WRITE:
        Gsp = tl.load(g_base + (steps - 1) * s_gc, mask=s_ok & (steps > 0), other=0.0)
        Ks = tl.load(
            k_base + steps[:, None] * s_kc + rk[None, :],
            mask=s_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
    for j0 in range(0, b0, BLOCK_J):
        rj = j0 + tl.arange(0, BLOCK_J)
        rows = rj < b0
        Gj = tl.load(g_base + rj * s_gc, mask=rows, other=0.0)
        both = rows[:, None] & s_ok[None, :]
        # The rows' k and G adjoints read here, with the block's other loads: after the value
        # loop's stores (each holds back every later load: the pointers may alias) they cost
        # two round trips more a block of rows.
        ok_k = rows[:, None] & k_ok[None, :]
        tile_k = DKA + b * s_dkb + h * s_dkh + rj[:, None] * s_dkc + rk[None, :]
        dK_rows = tl.load(tile_k, mask=ok_k, other=0.0)
        dg = DGA + b * s_dgb + h * s_dgh + rj * s_dgc
        dG_rows = tl.load(dg, mask=rows, other=0.0)
        E = tl.where(both, tl.exp(Gs[None, :] - Gj[:, None]), 0.0)  # (J, S)
        # (J, S): k_j . q_s, read from the chunk's Gram matrix (row s, column j)
        S1 = tl.load(
            QK + b * s_qkb + h * s_qkh + steps[None, :] * s_qkc + rj[:, None], mask=both, other=0.0
        )
        W = E * S1
        UD = tl.zeros((BLOCK_J, BLOCK_S), dtype=acc_t)
        if WRITE:
            E2 = tl.where(both, tl.exp(Gsp[None, :] - Gj[:, None]), 0.0)
            S2 = tl.load(
                KK + b * s_kkb + h * s_kkh + steps[None, :] * s_kkc + rj[:, None],
                mask=both,
                other=0.0,
            )  # k_j . k_s
            W2 = E2 * S2
            UD2 = tl.zeros((BLOCK_J, BLOCK_S), dtype=acc_t)
        for v0 in range(0, DV, BLOCK_DV):
            rv = v0 + tl.arange(0, BLOCK_DV)
            v_ok = rv < DV
            ok = rows[:, None] & v_ok[None, :]
            Uh = tl.load(u_base + rj[:, None] * s_uc + rv[None, :], mask=ok, other=0.0)
            DO = tl.load(
                DOB + kept + rs[:, None] * DV + rv[None, :],
                mask=s_ok[:, None] & v_ok[None, :],
                other=0.0,
            )  # (S, BV)
            UD += tl.dot(Uh, tl.trans(DO), input_precision="ieee", out_dtype=acc_t)
            add = tl.dot(W, DO, input_precision="ieee", out_dtype=acc_t)  # (J, BV)
            if WRITE:
                DP = tl.load(
                    DPB + kept + rs[:, None] * DV + rv[None, :],
                    mask=s_ok[:, None] & v_ok[None, :],
                    other=0.0,
                )
                UD2 += tl.dot(Uh, tl.trans(DP), input_precision="ieee", out_dtype=acc_t)
                add += tl.dot(W2, DP, input_precision="ieee", out_dtype=acc_t)
            tile = du_base + rj[:, None] * s_duc + rv[None, :]
            tl.store(tile, tl.load(tile, mask=ok, other=0.0) + add, mask=ok)
        dsd = E * UD
        dK_add = tl.dot(dsd, Qs, input_precision="ieee", out_dtype=acc_t)  # (J, DK)
        dG_add = -tl.sum(dsd * S1, axis=1)
        if WRITE:
            dsd2 = E2 * UD2
            dK_add += tl.dot(dsd2, Ks, input_precision="ieee", out_dtype=acc_t)
            dG_add -= tl.sum(dsd2 * S2, axis=1)
        tl.store(tile_k, dK_rows + dK_add, mask=ok_k)
        tl.store(dg, dG_rows + dG_add, mask=rows)
