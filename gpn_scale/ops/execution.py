"""How the ops run, beyond their tensors: one settings object for what tests, benchmarks and
the launch accounting switch on around a block of code.

    with execution(matmul_dtype=torch.bfloat16, assumed_sms=132):
        ...  # the engine's matmuls as under bf16 autocast; GEMM grids sized for 132 SMs

Training sets none of it but what an engine option asks of the launches (the defaults are
what a run on a GPU or CPU does). One
process-wide object, not a ContextVar: autograd runs CUDA backwards on its own device
threads, which see module state but not the caller's context variables.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch


@dataclass(frozen=True)
class Execution:
    # The models' matmuls (the GPN engine's, the baselines' head loss) run in this dtype as
    # under autocast, on devices autocast does not know (the launch accounting's meta tensors):
    # `autocast_dtype`.
    matmul_dtype: torch.dtype | None = None
    # The decode's Triton cross-entropy kernel on any device (CPU tensors under
    # TRITON_INTERPRET=1 in the tests).
    triton_anywhere: bool = False
    # The compiled CPU step kernels the engine runs on instead of the ones it would pick (a
    # benchmark build), wherever it would pick compiled kernels at all.
    step_kernels: ModuleType | None = None
    # The CUDA backend's chunk graphs are "captured" by this and wanted on any device (tests
    # of everything around the CUDA call: ops/gpn_step/graphs.py's eager stand-in).
    graph_capture: Callable[[Callable[[], Any]], tuple[Callable[[], None], Any]] | None = None
    # The CUDA backend sizes its GEMM grids for a GPU of this many SMs (dry runs: the GPU is
    # not there to ask).
    assumed_sms: int | None = None
    # ... and makes the choices that depend on the architecture for this one (compute
    # capability x 10: 90 Hopper, 80 Ampere; the compile gate's targets).
    assumed_arch: int | None = None
    # Every kernel launch of the GPU code paths is appended here (ops/launch.py) ...
    launches: list[Any] | None = None
    # ... and with `dry` none runs (the accounting runs the real code on meta tensors) ...
    dry: bool = False
    # ... and with `keep_args` each record keeps its kernel, arguments and meta-parameters.
    keep_args: bool = False
    # Time per engine phase is accumulated here (ops/gpn_step/phases.py).
    phases: Any | None = None
    # The time steps' Triton kernels are launched with programmatic dependent launch where
    # the GPU has it (ops/gpn_step/geometry.py); the CUDA backend sets this from the engine
    # option `dependent_launch` around its chunks.
    dependent_launch: bool = True
    # "deferred": the backward's side work (ops/gpn_step/overlap.py) runs as late as its
    # results are waited for, on any device (tests of the overlapped order on CPU).
    side_work: str | None = None


_CURRENT = Execution()


def current() -> Execution:
    return _CURRENT


@contextlib.contextmanager
def execution(**changes: Any) -> Iterator[Execution]:
    """Within the block the ops run with `changes` applied to the current settings (nested
    blocks add to the outer one's); restored on the way out, errors included."""
    global _CURRENT
    previous = _CURRENT
    _CURRENT = dataclasses.replace(previous, **changes)
    try:
        yield _CURRENT
    finally:
        _CURRENT = previous


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype a model's matmuls run in on `device_type` now: the execution's `matmul_dtype`
    where set (the launch accounting's meta tensors, which autocast does not know), else
    autocast's where it is on for that device, else None (the operands' own dtype)."""
    if _CURRENT.matmul_dtype is not None:
        return _CURRENT.matmul_dtype
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return None
    return torch.get_autocast_dtype(device_type) if enabled else None
