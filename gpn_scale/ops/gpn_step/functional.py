"""Small differentiable-by-hand pieces shared by the engine's chunk-wide work and the
PyTorch step reference: the norms, their backward, and matmuls in the autocast dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from gpn_scale.ops import meta_kernels


def rms(x: Tensor, eps: float, out: Tensor | None = None) -> Tensor:
    """RMSNorm without a weight (`out`: written in place, its values the same)."""
    return torch.mul(x, torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps), out=out)


def l2n(x: Tensor, out: Tensor | None = None) -> Tensor:
    return torch.mul(x, torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-12), out=out)


def rms_back(n: Tensor, x: Tensor, dn: Tensor, eps: float) -> Tensor:
    """Gradient of n = x * rsqrt(mean(x^2) + eps) at x, given dn."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return r * (dn - n * (dn * n).mean(-1, keepdim=True))


def l2n_back(pre: Tensor, dy: Tensor) -> Tensor:
    """Gradient of y = l2n(relu(pre)) at pre, given dy."""
    x = F.relu(pre)
    rho = torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-12)
    y = x * rho
    return (pre > 0) * rho * (dy - y * (y * dy).sum(-1, keepdim=True))


def silu_back(x: Tensor, dy: Tensor) -> Tensor:
    sig = torch.sigmoid(x)
    return dy * sig * (1 + x * (1 - sig))


def matmul(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    out: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """x @ weight (+ bias) in the weight's dtype (bf16 under autocast), result in x's dtype
    (or `out_dtype`). With the dtypes equal it is one GEMM launch (addmm with the bias), not
    cast + GEMM + add. `out`: a contiguous tensor of the result's shape the GEMM writes into."""
    out_dtype = out_dtype or x.dtype
    if weight.dtype != x.dtype or out_dtype != x.dtype:
        return linear_out(x.to(weight.dtype), weight, bias, out_dtype, out)
    x2 = x.reshape(-1, x.shape[-1])
    out2 = None if out is None else out.view(x2.shape[0], -1)
    y = torch.mm(x2, weight, out=out2) if bias is None else torch.addmm(bias, x2, weight, out=out2)
    return y.view(*x.shape[:-1], -1)


def mm_t(dy: Tensor, weight_t: Tensor) -> Tensor:
    """dy @ weight^T, given weight^T stored contiguous (a transposed view makes the few-row
    matmul ~2.5x slower on CPU); in the weight's (matmul) dtype, result in dy's dtype."""
    if dy.dtype == weight_t.dtype:
        return dy @ weight_t
    return (dy.to(weight_t.dtype) @ weight_t).to(dy.dtype)


def gpu_path(t: Tensor) -> bool:
    """The CUDA code path: on CUDA tensors, and on meta ones (the launch accounting runs the
    CUDA path's code on meta tensors, gpn_scale.accounting.gpu_model)."""
    return t.device.type in ("cuda", "meta")


def matmul_copy_dtype(t: Tensor, mm_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype the chunk-wide work keeps a copy of t's rows in for the GEMMs that read
    them: the matmul dtype on the GPU path under autocast (there the GEMM would cast them
    each time, and the kernel that makes them writes the copy in the same pass), else None
    (elsewhere the GEMMs take the state dtype's rows, `accumulate_mm`)."""
    return mm_dtype if mm_dtype is not None and mm_dtype != t.dtype and gpu_path(t) else None


def _meta_gemms_run(t: Tensor) -> None:
    """On meta tensors (the launch accounting, the kernel prebuild), make sure this torch
    runs the GEMMs with out_dtype there (ops/meta_kernels: torch 2.11's do not)."""
    if t.device.type == "meta":
        meta_kernels.ensure_meta_addmm_out_dtype()


def linear_out(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    out: Tensor | None = None,
) -> Tensor:
    """x @ weight (+ bias) with x, weight in the matmul dtype and the result in `out_dtype`
    (`out`: a contiguous tensor of the result's shape to write it into). On CUDA one GEMM
    that accumulates and writes in out_dtype (cuBLAS's dtype overload); elsewhere the GEMM in
    the matmul dtype, cast and bias added after."""
    x2 = x.reshape(-1, x.shape[-1])
    out2 = None if out is None else out.view(x2.shape[0], -1)
    if gpu_path(x) and weight.dtype != out_dtype:
        _meta_gemms_run(x)
        y = (
            torch.addmm(bias.to(out_dtype), x2, weight, out_dtype=out_dtype, out=out2)
            if bias is not None
            else torch.mm(x2, weight, out_dtype=out_dtype, out=out2)
        )
        return y.view(*x.shape[:-1], -1)
    y = (x @ weight).to(out_dtype)
    y = y if bias is None else y + bias
    return y if out is None else out.copy_(y)


def add_product_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b for operands already in the matmul dtype and a wider accumulator (the
    losses' float32 gradient sums of bf16 products over their blocks of rows: the tied
    embedding's dE += g^T h, the decoder's). On the CUDA path one GEMM adds its float32
    product to acc (as `accumulate_mm`); the form it replaces formed a bf16 product, copied it
    to float32 and added it, ~2.5x acc's bytes per block (the 130M model's 32000 x 768
    embedding, 256 blocks a step at B = 128), and rounded each block's product to bf16
    before the sum. Elsewhere (CPU, equal dtypes) that form, unchanged."""
    if a.dtype != acc.dtype and gpu_path(acc):
        accumulate_mm(acc, a, b, a.dtype)
        return
    acc += (a @ b).to(acc.dtype)


def accumulate_mm(acc: Tensor, a: Tensor, b: Tensor, mm_dtype: torch.dtype | None) -> None:
    """acc += a @ b, accumulated in acc's dtype. Under autocast on CUDA the operands go in the
    matmul dtype (bf16 tensor cores, fp32 accumulation straight into acc: cuBLAS beta = 1);
    otherwise in acc's dtype (float32 or float64: the exactness tests stay in IEEE)."""
    if mm_dtype is not None and gpu_path(acc):
        _meta_gemms_run(acc)
        torch.addmm(acc, a.to(mm_dtype), b.to(mm_dtype), out_dtype=acc.dtype, out=acc)
        return
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
