"""Kernel launches that can be recorded instead of (or besides) run.

Every Triton launch of the GPU code paths (the CUDA step backend, the fused cross-entropy)
goes through `launch`; within `recording()` each is recorded with the bytes it must move
and its FLOPs, and with `dry=True` nothing runs: `gpn_scale.accounting.gpu_model` runs the real
code on meta tensors at the real sizes that way. With `keep_args=True` a record also holds
the kernel, its arguments and meta-parameters: `gpn_scale.accounting.gpu_compile` specialises
and compiles each launch ahead of time from them, as Triton's JIT would on the GPU.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from gpn_scale.ops.execution import current, execution
from gpn_scale.ops.triton_interpreter import prepare_interpreter


@dataclass
class Launch:
    """One kernel launch of the code path: what the accounting reads."""

    name: str
    phase: str  # "forward step" | "forward chunk" | "reverse step" | "reverse chunk",
    # or the engine phase it runs in (e.g. "decode")
    grid: tuple[int, ...]
    bytes: int  # HBM bytes it must move at least (its operands read, outputs written)
    flops: int
    # Only within recording(keep_args=True): the @triton.jit kernel and what it was given.
    kernel: Any = field(default=None, repr=False, compare=False)
    args: tuple = field(default=(), repr=False, compare=False)
    meta: dict = field(default_factory=dict, repr=False, compare=False)
    # A GEMM through cuBLAS (ATen), not a kernel of ours: the accounting prices it at the
    # share of the copy bandwidth cuBLAS reaches at a step's few rows (accounting/ceilings.py).
    cublas: bool = False


@contextlib.contextmanager
def recording(dry: bool = False, keep_args: bool = False) -> Iterator[list[Launch]]:
    """Record every launch of the GPU code paths within the block; `dry`: record only, run no
    kernel (for meta tensors: the accounting runs the real code path at the real sizes);
    `keep_args`: each record also keeps the kernel, its arguments and meta-parameters."""
    with execution(launches=[], dry=dry, keep_args=keep_args) as ex:
        yield ex.launches  # type: ignore[misc]


def is_dry() -> bool:
    return current().dry


def nbytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def launch(
    kernel, grid: tuple[int, ...], name: str, phase: str, nbytes: int, flops: int, *args, **meta
) -> None:
    ex = current()
    if ex.launches is not None:
        if ex.keep_args:
            ex.launches.append(Launch(name, phase, grid, nbytes, flops, kernel, args, dict(meta)))
        else:
            ex.launches.append(Launch(name, phase, grid, nbytes, flops))
    if not ex.dry:
        if os.environ.get("TRITON_INTERPRET") == "1":
            prepare_interpreter()  # its bf16 casts rounded as the GPU's, in any process
        kernel[grid](*args, **meta)


COLLECTIVE = "all-reduce"  # the name prefix of a recorded collective


def record_collective(name: str, phase: str, nbytes: int) -> None:
    """Record a collective of the tensor-parallel group (an NCCL all-reduce of `nbytes`)."""
    record = current().launches
    if record is not None:
        record.append(Launch(f"{COLLECTIVE} {name}", phase, (1,), nbytes, 0))


def record_aten(name: str, phase: str, nbytes: int, flops: int = 0, cublas: bool = False) -> None:
    """Record a launch the driver makes through ATen (a copy, a fill, a batched matmul);
    `cublas`: a step GEMM through cuBLAS (`Launch.cublas`)."""
    record = current().launches
    if record is not None:
        record.append(Launch(name, phase, (1,), nbytes, flops, cublas=cublas))
