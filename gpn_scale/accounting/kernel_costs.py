"""Per launch, what its price depends on beyond its bytes and FLOPs (`KernelCost`): the
compiled variant's occupancy and spills, the GEMMs' tile geometry (weight bytes in flight,
L2 -> SM traffic), every other kernel's dependent round trips per program, and the host's
argument binding of an eager launch. `pricing.py` turns these into seconds.

Where the facts come from, in order: the facts a given device run recorded for the kernels
that ran there (`gpu_model --against`); the variant compiled for the target (`gpu_compile`,
its facts cache); the facts the newest committed device run recorded for a kernel of that
name (`docs/device-runs/*/kernels.json`: what sweeps price with, without compiling); else 1
resident program per SM and pipelined GEMM tiles. `KernelCost.facts` says which.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, replace
from typing import Any

from gpn_scale.accounting import device_runs, gpu_compile, round_trips
from gpn_scale.accounting.gpu_compile_ptx import same_file


@dataclass(frozen=True)
class KernelCost:
    """What the compiled variant of one launch adds to its price (`accounting/pricing.py`)."""

    kernel: str
    programs: int
    blocks_per_sm: int
    threads: int  # per program
    spill_bytes: int  # per thread: spill stores + spill loads (local memory traffic)
    in_flight: int  # GEMMs: unique weight bytes one program keeps in flight; 0: not a GEMM
    host_s: float  # the host's time for Triton's argument binding of an eager launch
    grid: tuple[int, ...] = ()
    trips: tuple[int, ...] = ()  # round trips per program, by value of grid axis 1
    # warp-instructions one program issues (its PTX, loops counted as they run), by value of
    # grid axis 1; 0: unknown
    issued: tuple[float, ...] = ()
    # by value of grid axis 1, each software-pipelined loop's (iterations whose loads were
    # issued ahead, its body's instructions per warp, stages): `pricing.pipeline_waits`
    pipelined: tuple[tuple[tuple[float, int, int], ...], ...] = ()
    l2_bytes: int = 0  # GEMMs: A and W tiles read from L2 by all programs
    m_blocks: int = 1  # GEMMs: programs reading the same weight tile (grid axis 0)
    facts: str = "compiled"  # where occupancy came from: compiled | device run | assumed
    # SMs its programs leave to the side stream (a memory kernel's RESERVED_SMS)
    reserved_sms: int = 0


def gemm_geometry(rec: Any, w_pipelined: bool, num_stages: int) -> tuple[int, int, int]:
    """(unique weight bytes one program keeps in flight, L2 -> SM bytes of all programs,
    programs sharing each weight tile) of a `linear_kernel` launch. Triton multi-buffers the
    K loop (num_stages - 1 tiles ahead) where the weight is loaded with cp.async; else one
    tile at a time. Each program reads its rows of A over its K range (the A tile is an L2
    hit: the previous kernel just wrote it) and a BLOCK_K x BLOCK_N weight tile per step."""
    names = list(inspect.signature(rec.kernel.fn).parameters)
    arg = dict(zip(names, rec.args))
    meta = rec.meta
    a, w = arg["A"], arg["W"]
    M, K = int(arg["M"]), int(arg["K"])
    bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
    k_range = meta.get("K_PER_SPLIT") or K if meta.get("SPLITS", 1) > 1 else K
    programs = 1
    for g in rec.grid:
        programs *= g
    rows = min(bm, M)
    per_program = rows * k_range * a.element_size() + k_range * bn * w.element_size()
    tile = bk * bn * w.element_size()
    in_flight = tile * (max(1, num_stages - 1) if w_pipelined else 1)
    return in_flight, programs * per_program, int(rec.grid[0])


def binding_seconds(records: list, repeats: int = 30) -> dict[tuple[str, str], float]:
    """Host time of Triton's per-launch argument binding (its binder and cache key: the part
    of `JITFunction.run` before the driver call) for each (kernel, launch name), measured
    here on the launches' own arguments (the best of 5 rounds: this machine is shared)."""
    _, knobs, GPUTarget, make_backend, create_binder = gpu_compile._triton()
    from triton.runtime.jit import compute_cache_key

    backend = make_backend(GPUTarget("cuda", 90, 32))
    out: dict[tuple[str, str], float] = {}
    for rec in records:
        if rec.kernel is None or (rec.kernel.fn.__name__, rec.name) in out:
            continue
        kernel = rec.kernel
        binder = create_binder(kernel.signature, kernel.params, backend)
        args = [gpu_compile._FakePointer(a) if hasattr(a, "data_ptr") else a for a in rec.args]
        kwargs = dict(rec.meta, debug=False)
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        key_cache: dict = {}
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(repeats):
                _, spec, options = binder(*args, **kwargs)
                compute_cache_key(key_cache, spec, options)
            best = min(best, (time.perf_counter() - t0) / repeats)
        out[(kernel.fn.__name__, rec.name)] = best
    return out


def launch_costs(
    records: list,
    target: gpu_compile.Target,
    jobs: int = 1,
    cache: gpu_compile.FactsCache | None = None,
    compile: bool = True,
    recorded: dict[tuple[str, str], dict] | None = None,
) -> list[KernelCost | None]:
    """Per launch (None for an ATen copy or a collective): its cost inputs. `recorded`
    ((kernel, launch name) -> facts, `device_runs.kernel_facts`): a run's own compiled
    facts, used first. `compile`: the variants the facts cache lacks are compiled (in `jobs`
    processes); otherwise their facts come from the cache, the newest committed device run
    or the assumption (see the module docstring)."""
    given = recorded or {}
    if any(r.kernel is not None and not hasattr(r.kernel, "signature") for r in records):
        # Triton's interpreter (the tests): no binder to specialise with and nothing to
        # compile; occupancy from a run's facts or the assumption, no host binding.
        newest = given or device_runs.newest_kernel_facts()[0]
        out_: list[KernelCost | None] = []
        for r in records:
            twin = gpu_compile.plain_twin(r)
            cost = None
            if r.kernel is not None:
                cost = _cost(twin or r, _Unspecialised(r.meta), None, _row(newest, r), target, {})
                if twin is not None:
                    cost = _reserved(r, cost, None, None, 0, target)
            out_.append(cost)
        return out_
    twins = [gpu_compile.plain_twin(r) for r in records]
    extra = [t for t in twins if t is not None]
    keys: list[str | None] = []
    variants = {v.key: v for v in gpu_compile.specialise(records + extra, target, keys)}
    keys, twin_keys = keys[: len(records)], iter(keys[len(records) :])
    cache = cache if cache is not None else gpu_compile.FactsCache(gpu_compile.default_cache_path())
    if compile:
        facts = gpu_compile.compile_variants(
            [(v, target) for v in variants.values()], jobs, cache, progress=False
        )
    else:
        facts = {(k, target.name): f for k in variants if (f := cache.get(k)) is not None}
    newest = {} if compile or recorded else device_runs.newest_kernel_facts()[0]
    binding = binding_seconds(records)
    out: list[KernelCost | None] = []
    for rec, key, twin in zip(records, keys, twins):
        if key is None:
            out.append(None)
            continue
        row = _row(given, rec)
        f = None if row is not None else facts.get((key, target.name))
        if row is None and f is None:
            row = _row(newest, rec)
        if twin is None:
            out.append(_cost(rec, variants[key], f, row, target, binding))
            continue
        twin_key = next(twin_keys) or key
        tf = facts.get((twin_key, target.name))
        plain = _cost(twin, variants[twin_key], tf, row, target, binding)
        out.append(_reserved(rec, plain, f, tf, variants[key].num_warps, target))
    return out


def _reserved(rec: Any, plain: KernelCost, f, tf, num_warps: int, target) -> KernelCost:
    """A memory kernel's item queue (`triton_kernels.memory_backward_kernel`,
    `memory_forward_kernel`, RESERVED_SMS > 0) runs each item as its plain grid's program, in a
    loop: priced as those programs (the plain variant's walk and instructions, `plain`), their
    instructions scaled by the two compiled variants' (the loop recomputes per item what a
    program computes once; its own instructions are not matched loop by loop), at the queue
    variant's occupancy, on the SMs it does not leave. Without both variants' facts, as the
    plain grid's."""
    out = replace(plain, reserved_sms=int(rec.meta["RESERVED_SMS"]))
    if f is None or tf is None or not tf.instructions:
        return out
    scale = f.instructions / tf.instructions
    return replace(
        out,
        blocks_per_sm=max(1, target.blocks_per_sm(f.registers, num_warps, f.shared)),
        spill_bytes=f.spill_stores + f.spill_loads,
        issued=tuple(x * scale for x in plain.issued),
    )


def _row(facts: dict[tuple[str, str], dict], rec: Any) -> dict | None:
    name = rec.kernel.fn.__name__
    return facts.get((name, rec.name)) or facts.get((name, ""))


class _Unspecialised:
    """What `_cost` reads of a variant, for a launch that was not specialised."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.num_warps = int(meta.get("num_warps", 4))
        self.options = {"num_stages": int(meta.get("num_stages", 3))}


def _cost(rec, v, f, row: dict | None, target, binding: dict) -> KernelCost:
    name = rec.kernel.fn.__name__
    stages = int(v.options.get("num_stages", 3))
    instructions, loops = 0, []
    by_line: tuple[str, list[list[int]]] = ("", [])
    if f is not None:
        blocks = target.blocks_per_sm(f.registers, v.num_warps, f.shared)
        spills, source = f.spill_stores + f.spill_loads, "compiled"
        w_pipelined = "W" in f.async_operands
        instructions, loops = f.instructions, f.loop_instructions
        by_line = (f.source_file, f.line_instructions)
    elif row is not None:
        blocks = target.blocks_per_sm(row["registers"], row["num_warps"], row["shared"])
        spills, source = row.get("spill_stores", 0) + row.get("spill_loads", 0), "device run"
        w_pipelined = "W" in row.get("async_operands", ["W"])
        instructions, loops = row.get("instructions", 0), row.get("loop_instructions", [])
    else:
        blocks, spills, source, w_pipelined = 1, 0, "assumed", True
    programs = 1
    for g in rec.grid:
        programs *= g
    grid = tuple(int(g) for g in rec.grid)
    issued: tuple[float, ...] = ()
    pipelined: tuple[tuple[tuple[float, int, int], ...], ...] = ()
    if name == "linear_kernel":
        in_flight, l2_bytes, m_blocks = gemm_geometry(rec, w_pipelined, stages)
        trips: tuple[int, ...] = ()
    else:
        in_flight, l2_bytes, m_blocks = 0, 0, 1
        g1 = grid[1] if len(grid) > 1 else 1
        # one walk per program class: along grid axis 1 only where the kernel branches on it
        programs_ = round_trips.programs_along_axis1(rec.kernel, rec.args, rec.meta, g1)
        trips = tuple(p.trips for p in programs_)
        issued = tuple(
            v.num_warps
            * issued_instructions(
                instructions, loops, p.loop_executions, skipped_instructions(by_line, p.skipped)
            )
            for p in programs_
        )
        pipelined = tuple(
            tuple(
                (ahead, loops[i], stages)
                for i, (stages, ahead) in enumerate(p.pipelined)
                if stages >= 2 and len(loops) == len(p.pipelined)
            )
            for p in programs_
        )
    return KernelCost(
        name,
        programs,
        max(1, blocks),
        32 * v.num_warps,
        spills,
        in_flight,
        binding.get((name, rec.name), 0.0),
        grid=grid,
        trips=trips,
        issued=issued,
        pipelined=pipelined,
        l2_bytes=l2_bytes,
        m_blocks=m_blocks,
        facts=source,
    )


def issued_instructions(
    total: int, loops: list[int], executions: tuple[float, ...], skipped: int = 0
) -> float:
    """Instructions one warp of a program issues: the code outside loops once but the
    `skipped` instructions of the branch arms it never takes (`skipped_instructions`; the
    arms of a branch it cannot resolve both count: an upper bound), each loop's own body as
    many times as it runs. Where the compiled loops do not match the source's (a loop
    unrolled or split), 0: unknown."""
    if not total or len(loops) != len(executions):
        return 0.0
    return total - sum(loops) - skipped + sum(n * e for n, e in zip(loops, executions))


def skipped_instructions(
    by_line: tuple[str, list[list[int]]], arms: tuple[tuple[str, int, int], ...]
) -> int:
    """The compiled instructions outside loops (`by_line`: the source file and its [count,
    *lines] rows, gpu_compile_ptx.line_instructions) that belong to the branch arms a program
    skips (`round_trips.Program.skipped`): on a line of one, or inlined from a helper called
    on one. Facts without lines (a device run's): 0."""
    path, rows = by_line
    spans = [(lo, hi) for file, lo, hi in arms if path and same_file(file, path)]
    if not spans:
        return 0
    return sum(
        row[0] for row in rows if any(lo <= line <= hi for line in row[1:] for lo, hi in spans)
    )
