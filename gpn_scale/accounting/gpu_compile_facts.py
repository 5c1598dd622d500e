"""Each variant compiled with `triton.compile(..., target=GPUTarget("cuda", arch, 32))` (the
ptxas in the triton wheel; no driver involved), in worker processes, and what the compiler
made of it (`Facts`), kept in a facts cache across runs (accounting/gpu_compile.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from gpn_scale.accounting.gpu_compile_cases import Target
from gpn_scale.accounting.gpu_compile_ptx import (
    line_instructions,
    parse_ptx_loads,
    parse_ptxas_log,
    ptx_instructions,
    source_operands,
)
from gpn_scale.accounting.gpu_compile_variants import Variant, _triton


# ------------------------------------------------------------------------ compilation
@dataclass
class Facts:
    """What the compiler made of one variant."""

    ok: bool
    error: str = ""
    registers: int = 0
    spill_stores: int = 0  # bytes per thread
    spill_loads: int = 0
    stack: int = 0  # bytes per thread
    shared: int = 0  # bytes per block (Triton's figure: static + dynamic)
    # global loads: source operand -> {bytes per load instruction: count} (from the PTX)
    loads: dict[str, dict[int, int]] = field(default_factory=dict)
    # source operands loaded with cp.async (global -> shared, what Triton's pipeliner emits
    # for multi-buffered loops); the others go through registers
    async_operands: list[str] = field(default_factory=list)
    wgmma: bool = False
    mma_sync: bool = False
    # PTX instructions of the kernel, and of each loop's own body (nested loops excluded),
    # in code order: with the loops' executions (round_trips.analyse) the instructions one
    # warp issues
    instructions: int = 0
    loop_instructions: list[int] = field(default_factory=list)
    # [count, *lines] of the instructions outside loops, by the kernel's source file's lines
    # they stand on (inlined helpers: each call site too): a skipped branch arm's are not a
    # program's
    line_instructions: list[list[int]] = field(default_factory=list)
    source_file: str = ""  # the file those lines are of
    local_accesses: int = 0  # ld.local / st.local in the PTX
    compile_s: float = 0.0
    logged: bool = True  # False: a Triton cache hit, no ptxas log (registers, spills unknown)

    def narrowest_load(self, operand: str) -> int | None:
        widths = self.loads.get(operand)
        return min(int(w) for w in widths) if widths else None


def _compile_job(job: dict) -> dict:
    """Compile one variant (in a worker process); returns `Facts` as a dict. Without a
    Triton cache to fill, it compiles into a temporary one, removed afterwards (a fresh
    cache also means a ptxas run, hence its log)."""
    if job.get("triton_cache"):
        return _compile_into(job, job["triton_cache"])
    with tempfile.TemporaryDirectory(prefix="gpn-aot-") as scratch:
        return _compile_into(job, scratch)


def _compile_into(job: dict, cache_dir: str) -> dict:
    triton, knobs, GPUTarget, _, _ = _triton()
    from triton.compiler.compiler import ASTSource

    # A variant already in a given cache is a hit: kept, but it has no ptxas log.
    knobs.cache.dir = cache_dir
    kernel = getattr(importlib.import_module(job["module"]), job["kernel"])
    src = ASTSource(kernel, job["signature"], job["constexprs"], job["attrs"])
    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                src, target=GPUTarget("cuda", job["arch"], 32), options=job["options"]
            )
    except Exception as exc:  # noqa: BLE001 - a compile failure is a finding, reported
        return dataclasses.asdict(
            Facts(
                False, f"{type(exc).__name__}: {str(exc)[:600]}", compile_s=time.perf_counter() - t0
            )
        )
    facts = Facts(True, compile_s=round(time.perf_counter() - t0, 2))
    parsed = parse_ptxas_log(log.getvalue())
    facts.logged = "registers" in parsed
    for k, v in parsed.items():
        setattr(facts, k, v)
    facts.shared = int(compiled.metadata.shared)
    ptx = compiled.asm["ptx"]
    path = inspect.getsourcefile(kernel.fn) or ""
    asynchronous: set[str] = set()
    facts.loads = parse_ptx_loads(ptx, source_operands(path), path, asynchronous)
    facts.async_operands = sorted(asynchronous)
    facts.instructions, facts.loop_instructions = ptx_instructions(ptx)
    facts.line_instructions = line_instructions(ptx, path) if path else []
    facts.source_file = path
    facts.wgmma = "wgmma" in ptx
    facts.mma_sync = "mma.sync" in ptx
    facts.local_accesses = len(re.findall(r"\b(?:ld|st)\.local", ptx))
    return dataclasses.asdict(facts)


def _job(v: Variant, target: Target, triton_cache: str | None) -> dict:
    return dict(
        module=v.module,
        kernel=v.kernel,
        signature=v.signature,
        constexprs=v.constexprs,
        attrs=v.attrs,
        options=v.options,
        arch=target.arch,
        triton_cache=triton_cache,
    )


# Bumped when Facts gains a field: entries written before lack it and are compiled again.
FACTS_SCHEMA = 6


class FactsCache:
    """Facts of variants already compiled (a variant's key hashes the kernel's source, the
    specialisation, the options and the architecture), kept in one JSON file."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, dict] = {}
        if path is not None and path.is_file():
            with contextlib.suppress(ValueError, OSError):
                blob = json.loads(path.read_text())
                if blob.get("triton") == _triton_version() and blob.get("schema") == FACTS_SCHEMA:
                    self.data = blob.get("facts", {})

    def get(self, key: str) -> Facts | None:
        raw = self.data.get(key)
        if raw is None:
            return None
        raw = dict(raw)
        raw["loads"] = {op: {int(w): n for w, n in ws.items()} for op, ws in raw["loads"].items()}
        return Facts(**raw)

    def put(self, key: str, facts: Facts) -> None:
        if facts.ok and facts.logged:
            self.data[key] = dataclasses.asdict(facts)

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        blob = dict(triton=_triton_version(), schema=FACTS_SCHEMA, facts=self.data)
        tmp.write_text(json.dumps(blob))
        os.replace(tmp, self.path)


def _triton_version() -> str:
    import triton

    return triton.__version__


CACHE_ENV = "GPN_SCALE_GPU_FACTS"


def default_cache_path() -> Path:
    """The facts cache: $GPN_SCALE_GPU_FACTS, else .cache/gpu-compile/facts.json in the
    checkout."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    root = Path(__file__).resolve().parents[2]
    return root / ".cache" / "gpu-compile" / "facts.json"


def compile_variants(
    variants: list[tuple[Variant, Target]],
    jobs: int,
    cache: FactsCache,
    triton_cache: str | None = None,
    progress: bool = True,
) -> dict[tuple[str, str], Facts]:
    """Facts per (variant key, target name): from the cache, else compiled in `jobs`
    processes (each compile runs ptxas; the large kernels take seconds each)."""
    out: dict[tuple[str, str], Facts] = {}
    todo: list[tuple[Variant, Target]] = []
    seen: set[tuple[str, str]] = set()
    for v, t in variants:
        if (v.key, t.name) in seen:
            continue
        seen.add((v.key, t.name))
        hit = None if triton_cache else cache.get(v.key)
        if hit is not None:
            out[(v.key, t.name)] = hit
        else:
            todo.append((v, t))
    # Longest first (the memory kernels) so that the pool's tail is short.
    todo.sort(key=lambda vt: ("memory" not in vt[0].kernel, vt[0].kernel))
    if todo:
        env_interpret = os.environ.pop("TRITON_INTERPRET", None)
        try:
            if jobs > 1 and len(todo) > 1:
                import multiprocessing

                ctx = multiprocessing.get_context("spawn")
                with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
                    results = pool.map(_compile_job, [_job(v, t, triton_cache) for v, t in todo])
                    for i, ((v, t), raw) in enumerate(zip(todo, results)):
                        out[(v.key, t.name)] = _store(cache, v, t, raw)
                        if progress:
                            _progress(i + 1, len(todo), v, t, out[(v.key, t.name)])
            else:
                for i, (v, t) in enumerate(todo):
                    out[(v.key, t.name)] = _store(
                        cache, v, t, _compile_job(_job(v, t, triton_cache))
                    )
                    if progress:
                        _progress(i + 1, len(todo), v, t, out[(v.key, t.name)])
        finally:
            if env_interpret is not None:
                os.environ["TRITON_INTERPRET"] = env_interpret
        cache.save()
    return out


def _store(cache: FactsCache, v: Variant, t: Target, raw: dict) -> Facts:
    facts = Facts(**raw)
    cache.put(v.key, facts)
    return facts


def _progress(i: int, n: int, v: Variant, t: Target, f: Facts) -> None:
    state = "ok" if f.ok else "FAILED"
    print(
        f"  [{i}/{n}] {t.name} {v.kernel} ({sorted(v.names)[0]}): {state}, {f.registers} regs, "
        f"spills {f.spill_stores}/{f.spill_loads} B, {f.compile_s:.1f} s",
        file=sys.stderr,
        flush=True,
    )
