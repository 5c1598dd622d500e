"""What this machine's caches give a CPU training step: load latency by working-set size, and
the rate one core streams a buffer at. The engine's roofline (gpn_scale.bench.engine) reads
against these: a backward step of SMALL streams 14.5 MB of weights, so whether that fits in
the cache level the step's other data also lives in decides what the two cost each other.

    python -m gpn_scale.bench.machine

Latency: a dependent chain of loads through a random permutation of the buffer's cache
lines (each load's address comes from the previous one, so nothing overlaps and no
prefetcher can guess). Streaming: each thread sums its own buffer with 512-bit (or 256-bit)
loads, best of several passes. Both by hand in C++ because neither can be expressed as
tensor ops: a tensor op would overlap the loads and measure bandwidth instead of latency.
Prints a table; nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import sys
from types import ModuleType

import torch

from gpn_scale.ops.gpn_step.step_kernels import (
    cpp_extension_quietly,
    cpu_build,
    packaged_ninja_first,
)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace {
double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

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

// GB/s each of `threads` threads reaches summing its own `megabytes` buffer (best pass).
std::vector<double> stream_gbps(double megabytes, int64_t threads, int64_t passes) {
  std::vector<double> rate(threads, 0.0);
  const int64_t n = int64_t(megabytes * (1 << 20)) / int64_t(sizeof(float));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::vector<float> buf(n, 1.0f);   // first touched by the thread that reads it
      float sink = 0;
      double best = 1e30;
      for (int64_t r = 0; r < passes; ++r) {
        const double t0 = seconds();
        using V = at::vec::Vectorized<float>;
        V a0(0.f), a1(0.f);
        int64_t i = 0;
        for (; i + 2 * V::size() <= n; i += 2 * V::size()) {
          a0 = a0 + V::loadu(buf.data() + i);
          a1 = a1 + V::loadu(buf.data() + i + V::size());
        }
        float lanes[V::size()];
        (a0 + a1).store(lanes);
        sink += lanes[0];
        best = std::min(best, seconds() - t0);
      }
      rate[t] = sink != 0 ? double(n) * sizeof(float) / best / 1e9 : 0.0;
    }
  });
  return rate;
}
"""


@functools.lru_cache(maxsize=1)
def _probe() -> ModuleType:
    capability, flags = cpu_build()
    with packaged_ninja_first():
        return cpp_extension_quietly().load_inline(
            name=f"gpn_scale_machine_probe_{capability}",
            cpp_sources=[_SOURCE],
            functions=["chase_ns", "stream_gbps"],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )


def latency_curve(sizes_mb: tuple[float, ...]) -> list[dict]:
    probe = _probe()
    return [
        dict(megabytes=mb, ns=min(probe.chase_ns(mb, 2_000_000) for _ in range(2)))
        for mb in sizes_mb
    ]


def streaming(sizes_mb: tuple[float, ...], threads: int) -> list[dict]:
    probe = _probe()
    return [
        dict(megabytes=mb, threads=threads, gbps=probe.stream_gbps(mb, threads, 20))
        for mb in sizes_mb
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
