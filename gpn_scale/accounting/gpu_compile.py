"""Every Triton kernel the CUDA path launches, compiled ahead of time for sm_90 and sm_80 on a
machine with no GPU and no driver, and what the compiler made of each.

    python -m gpn_scale.accounting.gpu_compile gpn_m_130m --batch 16,64      # the table
    python -m gpn_scale.accounting.gpu_compile --gate                        # CI's set; exit 1 on
                                                                        # any problem
    python -m gpn_scale.accounting.gpu_compile gpn_m_1b --tp 8 --arch sm_90  # one tp rank

How: the engine's training step runs on meta tensors in the launch accounting's dry mode
(`ops/launch.py`, arguments kept), so every launch is recorded with its grid, arguments and
meta-parameters at the real sizes. Each launch is specialised exactly as Triton's JIT would
specialise it on the GPU (its own binder: dtypes, 16-byte alignment of every pointer, ints
equal to 1 as constexprs, divisibility by 16), the distinct variants are compiled with
`triton.compile(..., target=GPUTarget("cuda", arch, 32))` (the ptxas in the triton wheel;
no driver involved), and each is read back: registers, spill stores/loads and stack from
the ptxas log, shared memory from the compiled metadata, CTAs per SM from those, and the
width of every global load per source operand from the PTX (`.loc` lines name the source
line of each `tl.load`). Tiny CPU tests cannot see any of this: spills, occupancy and load
width only appear at the real sizes.

The gate (`--gate`, and tests/accounting/test_gpu_compile.py) fails on a compile error, a spill
or a stack frame in any kernel, shared memory over the target's per-block limit, a step
GEMM that launches fewer programs than the GPU has SMs at a shipped config, or a loop the
accounting prices as software-pipelined whose tiles are not copied with cp.async
(`PIPELINED_OPERANDS`).

`--triton-cache DIR` compiles every variant into DIR (a Triton cache): a process whose
TRITON_CACHE_DIR is DIR then finds every kernel of these shapes compiled (the device check
builds one this way, `bench/gpu.py --triton-cache`). The cache is only valid for the same
triton build (its key hashes triton's sources and libtriton), so it is built where it runs.

Here: the command. Beside it: gpu_compile_cases.py (the targets, the cases, a step's
launches recorded), gpu_compile_variants.py (the launches specialised as Triton's JIT does),
gpu_compile_facts.py (the variants compiled, their facts and the facts cache),
gpu_compile_ptx.py (the ptxas log and the PTX read back) and gpu_compile_report.py (the
gate's checks, the offsets check and the table). The names callers use are importable from
here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from gpn_scale.accounting.gpu_compile_cases import (
    GATE_CASES,
    TARGETS,
    WIDE_CASES,
    Case,
    Target,
    model_config,
    plain_twin,
    record_launches,
)
from gpn_scale.accounting.gpu_compile_facts import (
    CACHE_ENV,
    FACTS_SCHEMA,
    Facts,
    FactsCache,
    compile_variants,
    default_cache_path,
)
from gpn_scale.accounting.gpu_compile_ptx import (
    parse_ptx_loads,
    parse_ptxas_log,
    ptx_instructions,
    source_operands,
)
from gpn_scale.accounting.gpu_compile_report import (
    BELOW_OCCUPANCY_BAR,
    FLOAT32_A_OPERANDS,
    INT32_MAX,
    MIN_ASYNC_BYTES_PER_SM,
    MIN_PROGRAMS_PER_SM,
    MIN_WAVE_FILL,
    PIPELINED_OPERANDS,
    STEP_PHASES,
    WEIGHT_OPERAND,
    Row,
    _extent,  # noqa: F401 - tests/accounting/test_gpu_compile.py reads it
    build_rows,
    known_below_occupancy,
    known_float32_a,
    narrow_offsets,
    problems,
    table,
)
from gpn_scale.accounting.gpu_compile_variants import (
    Variant,
    _FakePointer,  # noqa: F401 - accounting/kernel_costs.py binds launches with it
    _triton,  # noqa: F401 - accounting/kernel_costs.py binds launches with it
    specialise,
)

__all__ = [
    "BELOW_OCCUPANCY_BAR",
    "CACHE_ENV",
    "FLOAT32_A_OPERANDS",
    "FACTS_SCHEMA",
    "GATE_CASES",
    "INT32_MAX",
    "MIN_ASYNC_BYTES_PER_SM",
    "MIN_PROGRAMS_PER_SM",
    "MIN_WAVE_FILL",
    "PIPELINED_OPERANDS",
    "STEP_PHASES",
    "TARGETS",
    "WEIGHT_OPERAND",
    "WIDE_CASES",
    "Case",
    "Facts",
    "FactsCache",
    "Row",
    "Target",
    "Variant",
    "build_rows",
    "compile_variants",
    "default_cache_path",
    "known_below_occupancy",
    "known_float32_a",
    "main",
    "model_config",
    "narrow_offsets",
    "parse_ptx_loads",
    "parse_ptxas_log",
    "plain_twin",
    "problems",
    "ptx_instructions",
    "record_launches",
    "source_operands",
    "specialise",
    "table",
]


# ------------------------------------------------------------------------------ command
def _parse_cases(args: argparse.Namespace) -> list[Case]:
    if args.gate and not args.config:
        return list(GATE_CASES)
    cases = []
    overrides = tuple(_override(o) for o in args.set)
    for config in args.config or ["gpn_m_130m"]:
        for batch in args.batch:
            cases.append(
                Case(config, batch, args.dtype, args.tp, args.seq_len, overrides, args.gate)
            )
    return cases


def _override(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    if not key or not value:
        raise ValueError(f"--set {text!r}: expected key=value")
    low = value.lower()
    parsed: Any = value
    if low in ("true", "false"):
        parsed = low == "true"
    else:
        for kind in (float, int):  # an int where it is one
            with contextlib.suppress(ValueError):
                parsed = kind(value)
    return key, parsed


def _what_if(items: list[str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(dict)
    for item in items:
        kernel, _, setting = item.partition(":")
        key, _, value = setting.partition("=")
        if not kernel or not key or not value:
            raise ValueError(f"--meta {item!r}: expected KERNEL:KEY=INT")
        out[kernel][key] = int(value)
    return dict(out)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="*", help="model configs (default gpn_m_130m)")
    parser.add_argument("--batch", type=_ints, default=[16], help="sequences, e.g. 16,64")
    parser.add_argument("--dtype", choices=("bf16", "fp32", "fp64"), default="bf16")
    parser.add_argument("--tp", type=int, default=1, help="one rank of a tp group of this size")
    parser.add_argument("--seq-len", type=int, default=0, help="default: two chunks")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    parser.add_argument("--arch", default="sm_90,sm_80", help=f"of {', '.join(TARGETS)}")
    parser.add_argument(
        "--gate",
        action="store_true",
        help="CI's gate: without configs, its set of cases; exit 1 on any problem",
    )
    parser.add_argument("--kernel", default="", help="only these kernels (comma-separated)")
    parser.add_argument(
        "--meta",
        action="append",
        default=[],
        help="what-if launch setting KERNEL:KEY=INT, e.g. memory_backward_kernel:num_warps=16",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument("--json", type=Path, help="also write every variant's facts here")
    parser.add_argument("--no-cache", action="store_true", help="compile everything afresh")
    parser.add_argument(
        "--triton-cache",
        type=Path,
        help="compile every variant into this Triton cache directory (for TRITON_CACHE_DIR)",
    )
    return parser


def _write_json(path: Path, rows: list[Row]) -> None:
    """Every variant's facts, one entry per row."""
    path.write_text(
        json.dumps(
            [
                dict(
                    case=r.case.label,
                    target=r.target.name,
                    kernel=r.variant.kernel,
                    names=sorted(r.variant.names),
                    phases=sorted(r.variant.phases),
                    grids=sorted(r.variant.grids),
                    launches=r.variant.launches,
                    num_warps=r.variant.num_warps,
                    blocks_per_sm=r.blocks_per_sm(),
                    signature=r.variant.signature,
                    **dataclasses.asdict(r.facts),
                )
                for r in rows
            ],
            indent=1,
            default=str,
        )
    )


def _verdict(rows: list[Row], found: list[str], gate: bool) -> int:
    """The known misses of the occupancy bar, then the problems (exit 1 under the gate)."""
    for title, known in (
        ("below the occupancy bar", known_below_occupancy(rows)),
        ("step GEMMs reading a float32 A operand", known_float32_a(rows)),
    ):
        if known:
            print(f"\nknown, {title} (issue 34):")
            for line in known:
                print(f"  - {line}")
    if found:
        print("\nproblems:")
        for p in found:
            print(f"  - {p}")
        return 1 if gate else 0
    print("no compile errors, no spills, shared memory within limits")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cases = _parse_cases(args)
        targets = [TARGETS[a.strip()] for a in args.arch.split(",") if a.strip()]
        what_if = _what_if(args.meta)
    except (ValueError, KeyError) as exc:
        print(f"gpu_compile: {exc} (targets: {', '.join(TARGETS)})", file=sys.stderr)
        return 2
    from gpn_scale.core.config import ConfigError

    cache = FactsCache(None if args.no_cache else default_cache_path())
    t0 = time.perf_counter()
    try:
        rows = build_rows(
            cases,
            targets,
            max(1, args.jobs),
            cache,
            str(args.triton_cache) if args.triton_cache else None,
            kernels={k for k in args.kernel.split(",") if k} or None,
            what_if=what_if,
        )
    except ConfigError as exc:
        print(f"gpu_compile: {exc}", file=sys.stderr)
        return 2
    print(table(rows))
    found = problems(rows)
    if args.gate:  # the largest shapes: offsets past 2**31 (recorded, nothing compiled)
        for case in WIDE_CASES:
            found += [f"{case.label}: {p}" for p in narrow_offsets(record_launches(case))]
    n_var = len({(r.variant.key, r.target.name) for r in rows})
    print(
        f"{n_var} variants of {len({r.variant.kernel for r in rows})} kernels over "
        f"{len(cases)} cases and {len(targets)} targets in {time.perf_counter() - t0:.0f} s"
    )
    if args.json:
        _write_json(args.json, rows)
    return _verdict(rows, found, args.gate)


if __name__ == "__main__":
    # Compiled kernels, never the interpreter's (the kernels module is imported later).
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(main())
