"""Meta kernels (shapes and dtypes, no data) for the ATen GEMMs the CUDA path calls, where
the installed torch's own are wrong.

The launch accounting (accounting/gpu_model) and the device check's kernel prebuild run the
CUDA path on meta tensors, and the accounting's recorder (accounting/kernel_record.
AtenRecorder) prices every ATen op it sees. A GEMM that cannot run on meta is therefore a
launch the accounting never prices: under torch 2.11 (the H200 image's) that was the
parallel recompute's addmm, ~12% of the predicted 130M step.

torch 2.11 registers its addmm decomposition for every overload of addmm, the `dtype` ones
(cuBLAS's accumulate-in-float32 GEMM) included, and passes their out_dtype on as `beta`
(TypeError). Later torch registers it for addmm.default and addmm.out only. Where the probe
finds the broken kernel, `ensure_meta_addmm_out_dtype` registers the two below in its place:
the same op names, so the recorder sees the launch the GPU runs."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

# Registrations live as long as their Library object: this one, for the process.
_LIBRARY: torch.library.Library | None = None


@functools.cache
def meta_addmm_takes_out_dtype() -> bool:
    """Whether this torch's meta kernel runs addmm with out_dtype. The probe runs below any
    dispatch mode: the accounting's recorder would count it as a launch of the step it first
    ran in."""
    from torch.utils._python_dispatch import _disable_current_modes

    x = torch.empty(2, 2, device="meta", dtype=torch.bfloat16)
    with _disable_current_modes():
        try:
            torch.addmm(torch.empty(2, device="meta"), x, x, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            return False
    return True


def ensure_meta_addmm_out_dtype() -> None:
    """Make addmm with out_dtype run on meta tensors: nothing where torch's own kernel does,
    else register `addmm_dtype` and `addmm_dtype_out` as its Meta kernels (once a process)."""
    global _LIBRARY
    if meta_addmm_takes_out_dtype():  # (True once these are registered, too)
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("addmm.dtype", addmm_dtype, "Meta", allow_override=True)
    library.impl("addmm.dtype_out", addmm_dtype_out, "Meta", allow_override=True)
    _LIBRARY = library
    meta_addmm_takes_out_dtype.cache_clear()
    if not meta_addmm_takes_out_dtype():
        raise RuntimeError("registered a meta addmm.dtype, and addmm with out_dtype still fails")


def _result_shape(
    self: Tensor, mat1: Tensor, mat2: Tensor, out_dtype: torch.dtype
) -> tuple[int, int]:
    torch._check(
        mat1.dim() == 2 and mat2.dim() == 2,
        lambda: f"addmm: mat1 and mat2 must be matrices, got {mat1.dim()}-D and {mat2.dim()}-D",
    )
    torch._check(
        mat1.shape[1] == mat2.shape[0],
        lambda: (
            f"addmm: mat1 and mat2 shapes cannot be multiplied "
            f"({mat1.shape[0]}x{mat1.shape[1]} and {mat2.shape[0]}x{mat2.shape[1]})"
        ),
    )
    torch._check(
        mat1.dtype == mat2.dtype,
        lambda: f"addmm: mat1 and mat2 must have one dtype, got {mat1.dtype} and {mat2.dtype}",
    )
    torch._check(
        out_dtype in (mat1.dtype, torch.float32),
        lambda: f"addmm: out_dtype must be {mat1.dtype} or torch.float32, got {out_dtype}",
    )
    shape = (mat1.shape[0], mat2.shape[1])
    torch._check(
        self.dim() <= 2 and all(a in (1, b) for a, b in zip(self.shape[::-1], shape[::-1])),
        lambda: f"addmm: self of shape {tuple(self.shape)} does not broadcast to {shape}",
    )
    return shape


def addmm_dtype(
    self: Tensor,
    mat1: Tensor,
    mat2: Tensor,
    out_dtype: torch.dtype,
    *,
    beta: float = 1,
    alpha: float = 1,
) -> Tensor:
    """The meta form of beta * self + alpha * (mat1 @ mat2), accumulated and returned in
    out_dtype (aten::addmm.dtype)."""
    return mat1.new_empty(_result_shape(self, mat1, mat2, out_dtype), dtype=out_dtype)


def addmm_dtype_out(
    self: Tensor,
    mat1: Tensor,
    mat2: Tensor,
    out_dtype: torch.dtype,
    *,
    beta: float = 1,
    alpha: float = 1,
    out: Tensor,
) -> Tensor:
    """aten::addmm.dtype_out: as `addmm_dtype`, written into `out` (resized to the result's
    shape, as out= arguments are; its dtype must be out_dtype)."""
    shape = _result_shape(self, mat1, mat2, out_dtype)
    torch._check(
        out.dtype == out_dtype,
        lambda: f"addmm: out has dtype {out.dtype}, out_dtype is {out_dtype}",
    )
    if tuple(out.shape) != shape:
        out.resize_(shape)
    return out
