"""The fused CPU step kernels (`csrc/step_kernels.cpp`), compiled on first use.

On CPU a training step's matmuls are few-row GEMMs, and the PyTorch form of a step
(`gpn_scale.ops.gpn_step.reference`) spends as long again dispatching its ~75 (forward) /
~110 (reverse sweep) small elementwise and memory ops. These kernels run a whole chunk's
steps in one call: the matmuls still through ATen, everything else as plain loops over
batch rows. They compute exactly what the PyTorch steps compute (held equal by
tests/ops/test_gpn_step.py); `gpn_scale.ops.gpn_step.cpu` serves them to the engine, and
`gpn_scale.ops.gpn_step.registry` decides when (the environment variable
GPN_SCALE_STEP_KERNELS overrides the engine config's `step_backend`).

The build uses torch.utils.cpp_extension (g++ and ninja; ~1 min once, cached in
TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from gpn_scale.ops.execution import current

ENV_VAR = "GPN_SCALE_STEP_KERNELS"
_SOURCE = Path(__file__).parent / "csrc" / "step_kernels.cpp"


class StepKernelError(RuntimeError):
    """The fused step kernels were required but cannot be used."""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _capability() -> str:
    """The instruction set to build for. ATen's Vectorized<T> picks it from CPU_CAPABILITY
    (as torch's own kernels and inductor's do); we build on the machine that runs, at the
    level torch itself dispatches to there (which honours ATEN_CPU_CAPABILITY), never above
    what the CPU reports. AVX-512 over AVX2: the sweeps measured ~4% faster (docs/perf.md)."""
    flags = _cpu_flags()
    torch_level = torch.backends.cpu.get_cpu_capability().lower()
    if torch_level == "avx512" and {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return "avx512"
    return "avx2" if torch_level in ("avx2", "avx512") and {"avx2", "fma"} <= flags else "default"


def _build_flags(capability: str) -> list[str]:
    # -fopenmp: at::parallel_for is a header template whose `omp parallel` is silently serial
    # without it (the runtime is torch's own libgomp, already loaded, matched by soname).
    flags = ["-O3", "-fopenmp"]
    if capability == "avx512":  # the instruction sets of torch's own AVX512 kernels
        return flags + [
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mfma",
            "-DCPU_CAPABILITY=AVX512",
            "-DCPU_CAPABILITY_AVX512",
        ]
    if capability == "avx2":
        return flags + ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return flags + ["-DCPU_CAPABILITY=DEFAULT"]


@functools.lru_cache(maxsize=1)
def _load() -> ModuleType | Exception:
    return _build()


# A build for benchmarks only: the sequential phases without their matmuls (the roofline's
# "other work alone"; see gpn_scale.bench.engine). Never chosen by registry.kernels_for on its own.
WITHOUT_STEP_MATMULS = "GPN_SCALE_BENCH_WITHOUT_STEP_MATMULS"


def cpp_extension_quietly() -> ModuleType:
    """torch.utils.cpp_extension, imported without the warning about CUDA_HOME it logs on a
    machine without CUDA (irrelevant to a CPU-only extension; kept out of users' logs)."""
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        cpp_logger.setLevel(level)
    return cpp_extension


def cpu_build() -> tuple[str, list[str]]:
    """The instruction set CPU extensions are built for on this machine (see _capability),
    and the compiler flags for it."""
    capability = _capability()
    return capability, _build_flags(capability)


def _build(define: str | None = None) -> ModuleType | Exception:
    # The instruction set is in the name: nodes of a cluster that share a home directory
    # (hence the build cache) but not a CPU generation each get a build they can run.
    capability, flags = cpu_build()
    name = f"gpn_scale_step_kernels_{capability}" + (f"_{define.lower()}" if define else "")
    try:
        cpp_extension = cpp_extension_quietly()
        _notice_first_build(cpp_extension, name)
        with packaged_ninja_first():
            return cpp_extension.load(
                name=name,
                sources=[str(_SOURCE)],
                extra_cflags=flags + ([f"-D{define}"] if define else []),
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, a failed build: reported by the caller
        return exc


@contextlib.contextmanager
def packaged_ninja_first() -> Iterator[None]:
    """PATH with the `ninja` package's binary (a dependency) first, for the duration of a
    build. torch runs whichever `ninja` PATH finds, and two ninja versions (a system 1.11 and
    the package's 1.13, say) record their build logs differently, so each rebuilds what the
    other built: a minute each time a shell with the venv activated and one without take
    turns on one build cache (a shared home directory, a test suite's child processes)."""
    try:
        import ninja
    except ImportError:  # a source install without the package: whatever PATH has
        yield
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


@functools.cache
def benchmark_build(define: str) -> ModuleType:
    """A variant of the kernels compiled with `define` (e.g. WITHOUT_STEP_MATMULS), for
    benchmarks; raises StepKernelError if it cannot be built."""
    module = _build(define)
    if isinstance(module, Exception):
        raise StepKernelError(f"the benchmark build {define} failed ({_first_error(module)})")
    return module


def _notice_first_build(cpp_extension: ModuleType, name: str) -> None:
    """One line on stderr before a build (it takes about a minute; later loads are cached)."""
    try:  # a private helper of torch's: without it, only the notice is lost
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    except Exception:
        return
    # A build is due when no library is there, or the source is newer than every library
    # (an upgraded package: ninja rebuilds, and an .so of the old source is still there).
    built = [p.stat().st_mtime for p in build_dir.glob(f"{name}*.so")]
    if not built or max(built) < _SOURCE.stat().st_mtime:
        print(
            f"gpn_scale: compiling the fused CPU step kernels into {build_dir} "
            "(once; about a minute)",
            file=sys.stderr,
            flush=True,
        )


def build_error() -> str | None:
    """Why the kernels cannot be used here, with the fix (the registry's probe), or None."""
    module = _load()
    if not isinstance(module, Exception):
        return None
    return (
        f"the fused CPU step kernels could not be built ({_first_error(module)}); "
        f"install g++ and ninja, or set {ENV_VAR}=reference to use the PyTorch steps"
    )


def load() -> ModuleType:
    """The compiled kernels (or the benchmark override); StepKernelError when they cannot be
    built (the registry asks `build_error` first and falls back under `auto`)."""
    why = build_error()
    if why is not None:
        raise StepKernelError(why)
    module = _load()
    assert not isinstance(module, Exception)
    override = current().step_kernels
    return module if override is None else override


def _first_error(exc: Exception) -> str:
    """The compiler's first error line if there is one (the exception's own last line says
    only that ninja stopped), else the exception's last line."""
    text = str(exc).strip()
    for source in (text, str(exc.__cause__ or "")):
        for line in source.splitlines():
            if "error:" in line:
                return line.strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"
