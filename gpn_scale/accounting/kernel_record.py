"""One kernel's record in the launch accounting (`Op`) and the recorder of the ATen ops a
step runs (`AtenRecorder`): the pieces `gpu_model` (GPN) and `baseline_model` (Transformer++)
both count with, in a module of their own so that neither imports the other for them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpn_scale.ops.gpn_step import phases

SEQUENTIAL = ("sequential forward", "sequential backward")
_NO_LAUNCH = {
    "empty",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "empty_like",
    "detach",
    "alias",
    "lift_fresh",
    "_local_scalar_dense",
    "set_",
    "resize_",
    "_unsafe_view",
    "view",
    "_reshape_alias",
}


@dataclass
class Op:
    name: str
    phase: str
    bytes: int
    flops: int
    triton: bool
    collective: bool = False  # an all-reduce of the tp group (not a kernel of ours)
    cost: Any = None  # accounting.kernel_costs.KernelCost: the compiled variant's facts (or None)
    efficiency: float | None = None  # share of the dense peak its FLOPs run at (default EFF_FLOPS)
    dependent: bool = False  # a programmatic dependent launch (engine.dependent_launch)
    cublas: bool = False  # a step GEMM through cuBLAS (engine.cublas_gemms; Launch.cublas)


class AtenRecorder(TorchDispatchMode):
    """Every ATen op that would launch a kernel, with its operands' bytes and matmul FLOPs,
    attributed to the engine phase running it. The CUDA backend's own few ATen calls in the
    sequential phases are recorded by the backend itself (as named launches)."""

    def __init__(self, sequential: bool) -> None:
        super().__init__()
        self.sequential = sequential  # also record the sequential phases' ATen ops
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        phase = phases.current_phase() or "outside the loop"
        if func.is_view or name in _NO_LAUNCH or (phase in SEQUENTIAL and not self.sequential):
            return out
        # What the kernel reads and writes: its inputs and its results. An `out=` tensor is
        # written, not read (its result counts it); so is copy_'s destination.
        written_only = _flat(kwargs.get("out")) + (list(args[:1]) if name == "copy_" else [])
        reads = [t for t in _flat(args) + _flat(kwargs) if not _among(t, written_only)]
        tensors = [t for t in reads + _flat(out) if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.ops.append(Op(name, phase, nbytes, _matmul_flops(name, args), False))
        return out


def _among(t, tensors: list) -> bool:
    return any(t is u for u in tensors)


def _flat(x) -> list:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flat(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in _flat(item)]
    return [x]


def _matmul_flops(name: str, args) -> int:
    name = name.rstrip("_")  # addmm_ (in-place accumulation) costs what addmm does
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    if name in ("mm",) and len(shapes) >= 2:
        (m, k), (_, n) = shapes[0], shapes[1]
        return 2 * m * k * n
    if name == "addmm" and len(shapes) >= 3:
        (m, k), (_, n) = shapes[1], shapes[2]
        return 2 * m * k * n
    if name in ("bmm",) and len(shapes) >= 2:
        (b, m, k), (_, _, n) = shapes[0], shapes[1]
        return 2 * b * m * k * n
    if name == "baddbmm" and len(shapes) >= 3:
        (b, m, k), (_, _, n) = shapes[1], shapes[2]
        return 2 * b * m * k * n
    if name == "linalg_solve_triangular" and len(shapes) >= 2:
        *lead, n, _ = shapes[0]
        return math.prod(lead) * n * n * shapes[1][-1]
    return 0
