"""What the CUDA step backend's launch sizes and settings depend on: the interpreter or a GPU,
how many SMs it has and its architecture (or a dry run's assumed ones), whether its kernels
launch as dependents, powers of two, and a placeholder pointer.

Tests monkeypatch `interpreting` and `sm_count` here to run the GPU's block sizes under
Triton's interpreter; callers reach them as `geometry.interpreting(...)` so that they see it.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from gpn_scale.ops.execution import current
from gpn_scale.ops.gpn_step import triton_kernels as tk


def interpreting(t: Tensor) -> bool:
    """Whether `t`'s launches run in Triton's interpreter (CPU tensors: the tests)."""
    return t.device.type == "cpu"


def p2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Programs per SM the GEMMs aim for: one wave on the GPU (H100/H200: 132 SMs; the dry runs of
# the accounting and of accounting/gpu_compile assume it unless told otherwise). The interpreter
# pretends to 16 so that the tests' tiny GEMMs take the split-K path too.
DRY_RUN_SMS = 132
INTERPRETER_SMS = 16


# The architecture a dry run sizes for unless told otherwise (compute capability x 10: the
# H100/H200 the project trains on).
DRY_RUN_ARCH = 90


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _device_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def sm_count(t: Tensor) -> int:
    """The SMs a launch on `t`'s device fills: the execution's assumed number (dry runs), the
    interpreter's, the device's, or a dry run's default."""
    assumed = current().assumed_sms
    if assumed is not None:
        return assumed
    if interpreting(t):
        return INTERPRETER_SMS
    if t.is_cuda:
        return _device_sms(t.device.index if t.device.index is not None else 0)
    return DRY_RUN_SMS


def arch(t: Tensor) -> int:
    """The compute capability x 10 of `t`'s device as the launches see it: the execution's
    assumed one (dry runs), the device's, or a dry run's default (the interpreter's too)."""
    assumed = current().assumed_arch
    if assumed is not None:
        return assumed
    if t.is_cuda:
        return _device_arch(t.device.index if t.device.index is not None else 0)
    return DRY_RUN_ARCH


def dependent_launch(t: Tensor) -> dict[str, bool]:
    """The launch settings that make a time-step kernel on `t`'s device a programmatic
    dependent launch (PDL: it starts while the kernel before it finishes, and waits for it
    inside, `triton_kernels._await_predecessor`): on Hopper and later (a dry run's assumed
    arch too; sm_80 has no griddepcontrol), never in the interpreter (CPU tensors, whatever
    block sizes a test gives them), with a Triton that has grid dependency control, unless
    the engine turned it off (`engine.dependent_launch`)."""
    on = (
        current().dependent_launch
        and t.device.type in ("cuda", "meta")
        and arch(t) >= 90
        and tk.gdc_wait is not None  # this Triton has grid dependency control
    )
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def reserved_sms(t: Tensor, share: float) -> dict[str, int]:
    """The memory backward's launch settings that leave `share` of the SMs of `t`'s device to
    the side stream (`triton_kernels.memory_backward_kernel`): RESERVED_SMS, how many, and
    EMULATED_SMS, the SMs the interpreter's programs pretend to stand on (it has no %smid: CPU
    tensors, whatever block sizes a test gives them; 0 on a GPU or a dry run's meta tensors)."""
    n = sm_count(t)
    reserved = int(n * share)
    emulated = n if t.device.type == "cpu" and reserved else 0
    return {"RESERVED_SMS": reserved, "EMULATED_SMS": emulated}


_UNUSED: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def unused_pointer(like: Tensor) -> Tensor:
    """A small tensor for the pointer arguments a kernel variant never reads (of `like`'s
    dtype, so that it makes no other specialisation; small, so that nothing mistakes its
    extent for one the kernel indexes)."""
    key = (like.device, like.dtype)
    t = _UNUSED.get(key)
    if t is None:
        t = _UNUSED[key] = like.new_empty(16)
    return t
