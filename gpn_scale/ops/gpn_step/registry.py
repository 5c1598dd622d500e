"""Which step backend runs a chunk's steps: chosen at run time by device and availability
(the backends are declared in the one op-backend registry, `gpn_scale/ops/backends.py`).

The engine options' `step_backend` (options.py) asks for one (`auto` by default); the
environment variable GPN_SCALE_STEP_KERNELS, when set, overrides it (for benchmarks and
bisecting):

  auto       CPU tensors: the fused C++ kernels when they build, else (one warning) the
             PyTorch steps (under tensor parallelism always the PyTorch steps); CUDA
             tensors: the CUDA backend (Triton kernels) when Triton imports, else (one
             warning) the PyTorch steps; any other device: PyTorch steps
  reference  the PyTorch steps (any device; alias: python)
  cpu        the fused C++ kernels (CPU tensors; an error if they cannot be built, or under
             tensor parallelism: they do not split at the tp group's fixed points; alias: cpp)
  cuda       the Triton kernels (CUDA tensors; on CPU tensors only under TRITON_INTERPRET=1,
             which is how the tests run them; under tensor parallelism too: they split at
             the group's fixed points; alias: triton)
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from gpn_scale.ops.backends import ANY_DEVICE, OpBackend, OpRegistry, Request
from gpn_scale.ops.gpn_step import step_kernels
from gpn_scale.ops.gpn_step.interface import StepBackend
from gpn_scale.ops.gpn_step.reference import ReferenceBackend
from gpn_scale.ops.launch import is_dry

ENV_VAR = step_kernels.ENV_VAR


class StepBackendError(step_kernels.StepKernelError):
    """A step backend was asked for that cannot serve these tensors."""


def interpreting() -> bool:
    """Triton kernels run on CPU tensors in the interpreter (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def _cpu_backend(request: Request) -> StepBackend:
    from gpn_scale.ops.gpn_step.cpu import CpuBackend

    return CpuBackend(step_kernels.load())


@functools.lru_cache(maxsize=1)
def _cuda_backend_instance() -> StepBackend:
    """One per process: its captured chunk graphs are reused across engine calls."""
    from gpn_scale.ops.gpn_step.cuda import CudaBackend

    return CudaBackend()


def _triton_missing() -> str | None:
    # Not cached: a plain import of a loaded module is a dict lookup, and tests hide Triton.
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return (
            f"the CUDA step backend needs Triton ({exc}); install triton (it ships with "
            f"torch's CUDA wheels) or set {ENV_VAR}=reference"
        )
    return None


BACKENDS = OpRegistry("GPN step", ENV_VAR, "engine.step_backend", StepBackendError)
BACKENDS.register(
    OpBackend(
        "reference",
        (ANY_DEVICE,),
        0,
        aliases=("python",),
        description="the PyTorch steps",
        build=lambda request: ReferenceBackend(),
    )
)
BACKENDS.register(
    OpBackend(
        "cpu",
        ("cpu",),
        20,
        step_kernels.build_error,
        aliases=("cpp",),
        description="the fused C++ kernels (csrc/step_kernels.cpp)",
        build=_cpu_backend,
        splits_tp=False,
        tp_refusal="the fused C++ kernels do not split at the tp group's collectives",
    )
)
BACKENDS.register(
    OpBackend(
        "cuda",
        ("cuda",),
        20,
        _triton_missing,
        aliases=("triton",),
        description="the Triton kernels, chunks as CUDA graphs",
        build=lambda request: _cuda_backend_instance(),
        # The interpreter runs them on CPU tensors (tests); the launch accounting on meta.
        also_serves=lambda device_type: interpreting() or is_dry(),
        wrong_device_hint="set TRITON_INTERPRET=1 to run its kernels on CPU tensors (slowly, "
        "as the tests do)",
    )
)


def requested(config_choice: str = "auto") -> str:
    """The backend asked for: the environment override if set, else the config's choice."""
    return BACKENDS.requested(config_choice)


def select_backend(config_choice: str, device: torch.device, tp_size: int = 1) -> StepBackend:
    """The backend for tensors on `device` in a tp group of `tp_size` (the registry's rule;
    see the module docstring). Under tensor parallelism every backend must split the step at
    the group's fixed points (`collectives.py`): the PyTorch steps and the CUDA backend do,
    the fused C++ kernels do not, so on CPU `auto` picks the PyTorch steps and asking for
    `cpu` is refused."""
    return BACKENDS.select(config_choice, device.type, tp_size)


def cuda_graphs_status() -> dict[str, object]:
    """The process-wide CUDA backend's graph cache: graphs held, captures, replays,
    evictions, and why capture was turned off (None while it works); {} before any use."""
    if _cuda_backend_instance.cache_info().currsize == 0:
        return {}
    g = _cuda_backend_instance().graphs  # type: ignore[attr-defined]
    return dict(
        held=len(g), captures=g.captures, replays=g.replays, evictions=g.evictions, failed=g.failed
    )


def clear_cuda_graphs() -> None:
    """Drop the CUDA backend's captured graphs and their static buffers (between models: the
    graphs of one chunk shape of the 130M at B = 128 hold ~6 GiB)."""
    if _cuda_backend_instance.cache_info().currsize:
        _cuda_backend_instance().graphs.clear()  # type: ignore[attr-defined]


def kernels_for(device: torch.device, config_choice: str = "auto") -> ModuleType | None:
    """The compiled CPU kernels when the step-backend choice would run them for tensors on
    `device` (the environment override included), else None."""
    backend = select_backend(config_choice, device)
    return getattr(backend, "module", None) if backend.name == "cpu" else None
