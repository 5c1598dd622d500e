"""What this machine's caches give a CPU training step: load latency by working-set size, and
the rate one core streams a buffer at. The engine's roofline (gpn_scale.bench.engine) reads
against these: a backward step of SMALL streams 14.5 MB of weights, so whether that fits in
the cache level the step's other data also lives in decides what the two cost each other.

    python -m gpn_scale.bench.machine

Latency: a dependent chain of loads through a random permutation of the buffer's cache
lines (each load's address comes from the previous one, so nothing overlaps and no
prefetcher can guess). Streaming: each thread sums its own buffer with vector loads at the
build's instruction set (512- or 256-bit), best of several passes. Both by hand in C++
because neither can be expressed as tensor ops: a tensor op would overlap the loads and
measure bandwidth instead of latency.
Prints a table; nothing is asserted.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from gpn_scale.ops.gpn_step.step_kernels import cpu_build

# Plain C++ with no torch headers, built with the system compiler and loaded through ctypes:
# through torch's extension build (torch/extension.h, ATen's vector type and parallel_for)
# this 2 KB file took ~35 s to compile on first use, plain it takes ~2 s. The streaming loop
# keeps two vector sums in registers at the build's instruction set (cpu_build: the step
# kernels' flags), as the ATen version's two Vectorized<float> did.
_SOURCE = r"""
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

namespace {
double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// 16 floats: one 512-bit register, or two 256-bit ones (GCC/Clang vector extension).
typedef float V16 __attribute__((vector_size(64)));

double stream_one(int64_t n, int64_t passes) {
  std::vector<float> buf(n, 1.0f);   // first touched by the thread that reads it
  constexpr int64_t W = 16;
  float sink = 0;
  double best = 1e30;
  for (int64_t r = 0; r < passes; ++r) {
    const double t0 = seconds();
    V16 a0 = {0}, a1 = {0};   // two independent sums in registers
    for (int64_t i = 0; i + 2 * W <= n; i += 2 * W) {
      V16 x0, x1;
      std::memcpy(&x0, buf.data() + i, sizeof x0);   // unaligned vector loads
      std::memcpy(&x1, buf.data() + i + W, sizeof x1);
      a0 += x0;
      a1 += x1;
    }
    sink += (a0 + a1)[0];
    best = std::min(best, seconds() - t0);
  }
  return sink != 0 ? double(n) * sizeof(float) / best / 1e9 : 0.0;
}
}  // namespace

extern "C" {
// Nanoseconds per load of a chase through `megabytes` of randomly ordered cache lines.
double chase_ns(double megabytes, int64_t loads) {
  const int64_t lines = std::max<int64_t>(2, int64_t(megabytes * (1 << 20)) / 64);
  std::vector<int64_t> order(lines);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin() + 1, order.end(), std::mt19937_64(1));
  std::vector<int64_t> next(lines * 8);   // one int64 used per 64-byte line
  for (int64_t i = 0; i < lines; ++i) next[order[i] * 8] = order[(i + 1) % lines] * 8;
  int64_t p = 0;
  for (int64_t i = 0; i < lines; ++i) p = next[p];   // warm: the set is where it settles
  const double t0 = seconds();
  for (int64_t i = 0; i < loads; ++i) p = next[p];
  const double ns = (seconds() - t0) / double(loads) * 1e9;
  return p >= 0 ? ns : -1.0;   // uses p, so the chain is not optimised away
}

// GB/s each of `threads` threads reaches summing its own `megabytes` buffer (best pass),
// written to rate[0 .. threads).
void stream_gbps(double megabytes, int64_t threads, int64_t passes, double* rate) {
  const int64_t n = int64_t(megabytes * (1 << 20)) / int64_t(sizeof(float));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([=] { rate[t] = stream_one(n, passes); });
  for (auto& th : pool) th.join();
}
}
"""


class ProbeBuildError(RuntimeError):
    """The probe's C++ could not be built here (no compiler, or it failed)."""


def _build_dir() -> Path:
    """Where built probes are kept: beside the torch extensions (TORCH_EXTENSIONS_DIR, which
    the tests point at the checkout), else the user's cache."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpn_scale"
    )
    return Path(root) / "machine_probe"


@functools.lru_cache(maxsize=1)
def _probe() -> ctypes.CDLL:
    capability, flags = cpu_build()
    flags = [f for f in flags if f != "-fopenmp"]  # threads here are std::thread
    digest = hashlib.sha256((_SOURCE + " ".join(flags)).encode()).hexdigest()[:16]
    library = _build_dir() / f"probe_{capability}_{digest}.so"
    if not library.exists():
        compiler = os.environ.get("CXX") or "c++"
        if shutil.which(compiler) is None:
            raise ProbeBuildError(
                f"machine probe: no C++ compiler '{compiler}' on PATH; install g++ or set CXX"
            )
        library.parent.mkdir(parents=True, exist_ok=True)
        # built under a temporary name and renamed: processes building at once each finish
        # with a whole library, and the last rename wins
        with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
            source, built = Path(scratch) / "probe.cpp", Path(scratch) / library.name
            source.write_text(_SOURCE)
            cmd = [compiler, *flags, "-std=c++17", "-shared", "-fPIC", "-pthread"]
            proc = subprocess.run(
                [*cmd, str(source), "-o", str(built)], capture_output=True, text=True
            )
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                raise ProbeBuildError(
                    f"machine probe: '{compiler}' failed to build it ({last}); "
                    "check the C++ compiler (CXX)"
                )
            os.replace(built, library)
    lib = ctypes.CDLL(str(library))
    lib.chase_ns.restype = ctypes.c_double
    lib.chase_ns.argtypes = [ctypes.c_double, ctypes.c_int64]
    lib.stream_gbps.restype = None
    lib.stream_gbps.argtypes = [
        ctypes.c_double,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.POINTER(ctypes.c_double),
    ]
    return lib


def latency_curve(sizes_mb: tuple[float, ...]) -> list[dict]:
    probe = _probe()
    return [
        dict(megabytes=mb, ns=min(probe.chase_ns(mb, 2_000_000) for _ in range(2)))
        for mb in sizes_mb
    ]


def _stream(probe: ctypes.CDLL, mb: float, threads: int, passes: int) -> list[float]:
    rates = (ctypes.c_double * threads)()
    probe.stream_gbps(mb, threads, passes, rates)
    return list(rates)


def streaming(sizes_mb: tuple[float, ...], threads: int) -> list[dict]:
    probe = _probe()
    return [
        dict(megabytes=mb, threads=threads, gbps=_stream(probe, mb, threads, 20)) for mb in sizes_mb
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes",
        default="1,2,4,6,8,12,16,24,32,64",
        help="working-set sizes in MB for the latency curve",
    )
    args = parser.parse_args(argv)
    sizes = tuple(float(s) for s in args.sizes.split(","))
    try:
        _probe()
    except ProbeBuildError as exc:
        print(f"gpn_scale.bench.machine: {exc}", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("\n## Load latency by working set (dependent random loads, one per cache line)")
    print(f"{'MB':>6} {'ns/load':>8}")
    for row in latency_curve(sizes):
        print(f"{row['megabytes']:>6g} {row['ns']:>8.1f}")
    print("\n## Streaming: GB/s per thread, each summing its own buffer")
    print(f"{'MB/thread':>9} {'threads':>7}  GB/s per thread")
    for threads in sorted({1, torch.get_num_threads()}):
        for row in streaming((3.0, 7.0, 30.0), threads):
            rates = " ".join(f"{r:5.1f}" for r in row["gbps"])
            print(f"{row['megabytes']:>9g} {threads:>7}  {rates}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
