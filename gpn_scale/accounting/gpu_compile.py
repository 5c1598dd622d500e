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
or a stack frame in any kernel, shared memory over the target's per-block limit, or a step
GEMM that launches fewer programs than the GPU has SMs at a shipped config.

`--triton-cache DIR` compiles every variant into DIR (a Triton cache): a process whose
TRITON_CACHE_DIR is DIR then finds every kernel of these shapes compiled (the device check
builds one this way, `bench/gpu.py --triton-cache`). The cache is only valid for the same
triton build (its key hashes triton's sources and libtriton), so it is built where it runs.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import io
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


# ------------------------------------------------------------------------------ targets
@dataclass(frozen=True)
class Target:
    """A CUDA architecture and the per-SM resources occupancy is computed from."""

    name: str
    arch: int  # compute capability x 10
    gpu: str  # the GPU the SM count is of
    sm_count: int
    smem_per_block: int  # bytes a block may use (opt-in maximum)
    smem_per_sm: int
    regs_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    smem_reserved_per_block: int = 1024

    def blocks_per_sm(self, registers: int, num_warps: int, shared: int) -> int:
        """Resident blocks per SM: registers are allocated per warp in units of 256 (per
        thread rounded to 8), shared memory per block plus the driver's 1 KB reserve."""
        regs = -(-max(registers, 1) // 8) * 8
        per_warp = -(-regs * 32 // 256) * 256
        by_regs = self.regs_per_sm // (per_warp * num_warps)
        by_smem = self.smem_per_sm // (shared + self.smem_reserved_per_block)
        by_warps = self.max_warps_per_sm // num_warps
        return max(0, min(by_regs, by_smem, by_warps, self.max_blocks_per_sm))


TARGETS = {
    "sm_90": Target("sm_90", 90, "H100/H200", 132, 232448, 233472),
    "sm_80": Target("sm_80", 80, "A100", 108, 166912, 167936),
}


# ------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    """One training step whose launches are compiled: a model config (a name from
    configs/model, or "testing_tiny" for the tests' tiny config), its overrides, the
    batch, the matmul dtype and one rank of a tp group of `tp`."""

    config: str
    batch: int
    dtype: str = "bf16"  # "bf16" (autocast: bf16 operands, fp32 state) | "fp32" | "fp64"
    tp: int = 1
    seq_len: int = 0  # 0: two chunks
    overrides: tuple[tuple[str, Any], ...] = ()
    # A shipped paper config: the gate also holds its step GEMMs to one wave of programs and
    # to 16-byte loads of the weights.
    shipped: bool = False

    @property
    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.overrides)
        tp = f" tp={self.tp}" if self.tp > 1 else ""
        return f"{self.config}{extra}{tp} {self.dtype} B={self.batch}"


GATE_CASES = (
    Case("gpn_m_130m", 16, shipped=True),
    Case("gpn_m_130m", 64, shipped=True),
    Case("gpn_m_130m", 128, shipped=True),  # the GEMMs' 128-row tiles (8 warps)
    Case("gpn_m_130m_2l", 16, shipped=True),
    Case("gpn_m_130m_2l", 64, shipped=True),
    Case("gpn_m_1b", 16, tp=8),
    Case("testing_tiny", 3, dtype="fp32"),
    Case("testing_tiny", 3, dtype="fp64", overrides=(("n_layers", 2),)),
    Case("testing_tiny", 3, dtype="fp32", overrides=(("memory", False),)),
)


# The largest shapes a sweep may give one GPU (the offsets check records their launches,
# compiles nothing): a (B, T, d)-strided view then spans more than 2**31 elements.
WIDE_CASES = (
    Case("gpn_m_130m", 8192),
    Case("gpn_m_1b", 4096, tp=8),
)


def model_config(case: Case):
    from gpn_scale.models.gpn import load_model_config

    overrides = dict(case.overrides)
    if case.config == "testing_tiny":
        from gpn_scale.testing.models import tiny_config

        return tiny_config(step_backend="cuda", **overrides)
    return load_model_config(case.config, {"step_backend": "cuda", **overrides})


def record_launches(case: Case, sm_count: int | None = None) -> list:
    """Every kernel launch of one training step of `case` (meta tensors, nothing runs), with
    its kernel, arguments and meta-parameters; the GEMM grids sized for a GPU of
    `sm_count` SMs (default: the CUDA backend's dry-run assumption, an H100/H200)."""
    from gpn_scale.accounting.dry_run import as_tp_rank
    from gpn_scale.models.gpn import GPN
    from gpn_scale.models.gpn.parallelize import check_tp
    from gpn_scale.ops import launch
    from gpn_scale.ops.execution import execution
    from gpn_scale.ops.gpn_step.registry import ENV_VAR

    cfg = model_config(case)
    check_tp(cfg, case.tp, "tp")
    if case.tp > 1:
        cfg = cfg.replace(n_heads=cfg.n_heads // case.tp, d_ffn=cfg.d_ffn // case.tp)
    with torch.device("meta"):
        model = GPN(cfg)
    if case.dtype == "fp64":
        model = model.to(torch.float64)
    T = case.seq_len or 2 * cfg.engine.chunk_size
    tokens = torch.zeros(case.batch, T, dtype=torch.long, device="meta")
    settings = execution(
        matmul_dtype=torch.bfloat16 if case.dtype == "bf16" else None,
        assumed_sms=sm_count or None,
    )
    previous = os.environ.pop(ENV_VAR, None)
    try:
        with (
            launch.recording(dry=True, keep_args=True) as launches,
            settings,
            as_tp_rank(case.tp),
        ):
            model(tokens).loss.backward()
    finally:
        if previous is not None:
            os.environ[ENV_VAR] = previous
    return list(launches)


# ------------------------------------------------------------------- specialisation
_BASE = 0x7F00_0000_0000  # an allocation start: the caching allocator aligns blocks to 512 B


class _FakePointer:
    """What Triton's binder reads of a tensor argument: its dtype and address (whose
    alignment comes from the view's storage offset)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype = t.dtype
        self._address = _BASE + int(t.storage_offset()) * t.element_size()

    def data_ptr(self) -> int:
        return self._address


@dataclass
class Variant:
    """One distinct compilation of a kernel: what the JIT would compile once and reuse."""

    kernel: str  # the @triton.jit function's name
    module: str
    key: str  # hash of everything the compilation depends on
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    num_warps: int
    names: set[str] = field(default_factory=set)  # the launches' names
    phases: set[str] = field(default_factory=set)
    grids: set[tuple[int, ...]] = field(default_factory=set)
    launches: int = 0

    def programs(self) -> int:
        return max(_prod(g) for g in self.grids)

    def min_programs(self) -> int:
        return min(_prod(g) for g in self.grids)


def _prod(grid: Iterable[int]) -> int:
    n = 1
    for g in grid:
        n *= g
    return n


def _triton():
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    return triton, knobs, GPUTarget, make_backend, create_function_from_signature


def specialise(
    launches: Iterable, target: Target, keys: list[str | None] | None = None
) -> list[Variant]:
    """The distinct compilations the launches make on `target`, as Triton's JIT makes them;
    `keys`, when given, receives each launch's variant key (None: not a Triton launch)."""
    triton, knobs, GPUTarget, make_backend, create_binder = _triton()
    backend = make_backend(GPUTarget("cuda", target.arch, 32))
    binders: dict[int, Any] = {}
    variants: dict[str, Variant] = {}
    seen: dict[tuple, str] = {}  # what the binder reads of a launch -> its variant's key
    for rec in launches:
        kernel = rec.kernel
        if kernel is None:  # an ATen copy or a collective, recorded for the accounting
            if keys is not None:
                keys.append(None)
            continue
        # Triton's binder (~1 ms a launch) only reads dtypes, pointer alignment and, of ints,
        # whether they are 1, divisible by 16 and 32-bit: launches alike in those are one
        # variant, specialised once.
        probe = (id(kernel), *map(_arg_key, rec.args), *sorted(rec.meta.items()))
        key = seen.get(probe)
        if key is not None:
            v = variants[key]
            v.names.add(rec.name)
            v.phases.add(rec.phase)
            v.grids.add(tuple(rec.grid))
            v.launches += 1
            if keys is not None:
                keys.append(key)
            continue
        binder = binders.get(id(kernel))
        if binder is None:
            binder = binders[id(kernel)] = create_binder(kernel.signature, kernel.params, backend)
        args = [_FakePointer(a) if isinstance(a, torch.Tensor) else a for a in rec.args]
        kwargs = dict(rec.meta, debug=False)
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, spec, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound, spec, options
        )
        opts = {k: _plain(v) for k, v in options.__dict__.items()}
        consts = {k: _plain(v) for k, v in constexprs.items()}
        key = hashlib.sha256(
            repr(
                (
                    kernel.fn.__name__,
                    kernel.cache_key,
                    sorted(signature.items()),
                    sorted(consts.items(), key=repr),
                    sorted(attrs.items(), key=repr),
                    sorted(opts.items()),
                    target.arch,
                )
            ).encode()
        ).hexdigest()[:24]
        found = variants.get(key)
        if found is None:
            found = variants[key] = Variant(
                kernel.fn.__name__,
                kernel.fn.__module__,
                key,
                dict(signature),
                consts,
                dict(attrs),
                opts,
                options.num_warps,
            )
        found.names.add(rec.name)
        found.phases.add(rec.phase)
        found.grids.add(tuple(rec.grid))
        found.launches += 1
        seen[probe] = key
        if keys is not None:
            keys.append(key)
    return list(variants.values())


def _arg_key(a: Any) -> tuple:
    if isinstance(a, torch.Tensor):
        return ("t", a.dtype, (a.storage_offset() * a.element_size()) % 16 == 0)
    if isinstance(a, bool) or not isinstance(a, int):
        return ("v", type(a).__name__, a if isinstance(a, (bool, str)) or a is None else None)
    return ("i", a == 1, a % 16 == 0, -(2**31) <= a < 2**31)


def _plain(value: Any) -> Any:
    """Constexpr values and options as plain (picklable, printable) Python values."""
    if hasattr(value, "value") and type(value).__name__ == "constexpr":
        return value.value
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


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
    local_accesses: int = 0  # ld.local / st.local in the PTX
    compile_s: float = 0.0
    logged: bool = True  # False: a Triton cache hit, no ptxas log (registers, spills unknown)

    def narrowest_load(self, operand: str) -> int | None:
        widths = self.loads.get(operand)
        return min(int(w) for w in widths) if widths else None


_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str) -> dict[str, int]:
    """Registers, stack and spills from `ptxas -v` output (the last function reported)."""
    out: dict[str, int] = {}
    for m in _PTXAS.finditer(log):
        out["stack"], out["spill_stores"], out["spill_loads"] = map(int, m.groups())
    for m in re.finditer(r"Used (\d+) registers", log):
        out["registers"] = int(m.group(1))
    return out


_LOAD = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?(ld\.global[\w.:]*|cp\.async\.c[ag]\.shared\.global[\w.:]*)\s+(.*)$"
)
_WIDTH = {
    "b8": 1,
    "u8": 1,
    "s8": 1,
    "b16": 2,
    "u16": 2,
    "s16": 2,
    "f16": 2,
    "bf16": 2,
    "b32": 4,
    "u32": 4,
    "s32": 4,
    "f32": 4,
    "b64": 8,
    "u64": 8,
    "s64": 8,
    "f64": 8,
}


def _load_bytes(op: str, operands: str) -> int:
    if op.startswith("cp.async"):
        m = re.search(r"\],\s*(0x[0-9a-fA-F]+|\d+)", operands)
        return int(m.group(1), 0) if m else 0
    parts = op.split(".")
    vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d+", p)), 1)
    elem = next((_WIDTH[p] for p in reversed(parts) if p in _WIDTH), 0)
    return vec * elem


def source_operands(path: str) -> dict[int, str]:
    """Source line -> the pointer operand the `tl.load` on it reads (the first name of the
    address expression: `W` in `tl.load(W + rk[:, None] * ...`), over the kernel's file (a
    load may sit in a @triton.jit helper the kernel calls). Every line of a load spanning
    several lines maps to it: Triton's debug locations point at the call's line (3.8) or at
    its address argument's (3.6)."""
    out: dict[int, str] = {}
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "load"
            and node.args
        ):
            continue
        names = [n for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)]
        if not names:
            continue
        first = min(names, key=lambda n: (n.lineno, n.col_offset))  # the leftmost
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1):
            out.setdefault(line, first.id)
    return out


def parse_ptx_loads(
    ptx: str, operands: dict[int, str], source_file: str, asynchronous: set[str] | None = None
) -> dict[str, dict]:
    """Global load instructions of the PTX, by the source operand their `.loc` line reads;
    `asynchronous`, when given, receives the operands loaded with cp.async."""
    files = {
        int(m.group(1)): m.group(2)
        for m in re.finditer(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.M)
    }
    wanted = {n for n, path in files.items() if os.path.samefile(path, source_file)}
    loc: tuple[int, int] | None = None
    out: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for line in ptx.splitlines():
        m = re.match(r"^\s*\.loc\s+(\d+)\s+(\d+)", line)
        if m:
            loc = (int(m.group(1)), int(m.group(2)))
            continue
        m = _LOAD.match(line)
        if not m or loc is None or loc[0] not in wanted:
            continue
        operand = operands.get(loc[1], f"line {loc[1]}")
        out[operand][_load_bytes(m.group(1), m.group(2))] += 1
        if asynchronous is not None and m.group(1).startswith("cp.async"):
            asynchronous.add(operand)
    return {k: dict(v) for k, v in out.items()}


_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")


def ptx_instructions(ptx: str) -> tuple[int, list[int]]:
    """(instructions in the PTX, each loop's own instructions), loops found by their
    backward branches and listed by where they start; a nested loop's instructions are its
    own, not its parent's."""
    lines = [line.strip() for line in ptx.splitlines()]
    is_instr = [
        bool(t) and not t.startswith((".", "//", "{", "}", "(", ")", "$")) and not t.endswith(":")
        for t in lines
    ]
    labels = {m.group(1): i for i, t in enumerate(lines) if (m := _LABEL.match(t))}
    spans = sorted(
        (labels[m.group(1)], i)
        for i, t in enumerate(lines)
        if (m := _BRANCH.search(t)) and m.group(1) in labels and labels[m.group(1)] < i
    )
    own = []
    for a, b in spans:
        inner = sum(
            sum(is_instr[c : d + 1])
            for c, d in spans
            if a < c and d < b and not any(a < e < c and d < f < b for e, f in spans)
        )
        own.append(sum(is_instr[a : b + 1]) - inner)
    return sum(is_instr), own


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
FACTS_SCHEMA = 5


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


# ------------------------------------------------------------------------- offsets
INT32_MAX = 2**31 - 1


def _extent(t: torch.Tensor) -> int:
    """The largest element offset from the tensor's data pointer that indexing it reaches."""
    return sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()) if n > 0)


def _is_stride_param(name: str) -> bool:
    return name.startswith(("stride_", "s_"))


def _wide_params(fn) -> set[str]:
    """Parameters declared 64-bit (`name: tl.int64`)."""
    out = set()
    for name, p in inspect.signature(fn).parameters.items():
        text = p.annotation if isinstance(p.annotation, str) else repr(p.annotation)
        if "int64" in text:
            out.add(name)
    return out


def narrow_offsets(launches: Iterable) -> list[str]:
    """Where a kernel would compute an element offset past 2**31 in 32 bits: a tensor
    argument whose extent passes it must be indexed through stride parameters (the
    parameters after it named stride_* / s_*, the kernels' convention) declared
    `tl.int64`; its row offset (row * stride) is then 64-bit. One line per (kernel,
    argument), empty when every wide offset is 64-bit."""
    found: dict[tuple[str, str], str] = {}
    for rec in launches:
        if rec.kernel is None:
            continue
        fn = rec.kernel.fn
        names = list(inspect.signature(fn).parameters)
        wide = _wide_params(fn)
        for i, arg in enumerate(rec.args):
            if not isinstance(arg, torch.Tensor) or i >= len(names):
                continue
            extent = _extent(arg)
            if extent <= INT32_MAX:
                continue
            strides = []
            for name in names[i + 1 :]:
                if not _is_stride_param(name):
                    break
                strides.append(name)
            key = (fn.__name__, names[i])
            if not strides:
                found[key] = (
                    f"{fn.__name__}: {names[i]} spans {extent:,} elements but is indexed "
                    "without stride parameters (32-bit offsets)"
                )
            elif strides[0] not in wide:
                found[key] = (
                    f"{fn.__name__}: {names[i]} spans {extent:,} elements; declare its outer "
                    f"stride ({', '.join(strides)}) tl.int64"
                )
    return list(found.values())


# ------------------------------------------------------------------------------ report
# Step GEMMs: the few-row GEMMs that run once per time step (their weight is streamed once
# per step, so a grid smaller than the GPU leaves bandwidth unused every step).
STEP_PHASES = ("forward step", "reverse step")
# A split step GEMM's grid fills at least this share of its waves' program slots (a last
# wave of a few programs leaves most SMs idle while it streams; gemm.gemm_plan's split rule).
MIN_WAVE_FILL = 0.75
# A sequential kernel hides its memory latency with a second resident program per SM, or with
# this many bytes of asynchronous copies in flight per SM (a pipelined tl.dot's shared-memory
# ring: its shared memory x programs per SM).
MIN_PROGRAMS_PER_SM = 2
MIN_ASYNC_BYTES_PER_SM = 48 * 1024
# Sequential kernels known to miss that bar, and why: reported on every gate, not failed. A
# kernel leaves this list when it meets the bar (the gate then fails until it is removed).
BELOW_OCCUPANCY_BAR = {
    "memory_backward_flush_kernel": (
        "8 warps at up to 251 registers, one program per SM: at 4 warps or 128 registers it "
        "spills 150-260 B a thread (issue 34 item 1: the flush split over d_value)"
    ),
}
WEIGHT_OPERAND = {"linear_kernel": "W"}


@dataclass
class Row:
    case: Case
    target: Target
    variant: Variant
    facts: Facts

    @property
    def label(self) -> str:
        name = sorted(self.variant.names)[0]
        return self.variant.kernel if self.variant.kernel != "linear_kernel" else f"GEMM ({name})"

    def blocks_per_sm(self) -> int:
        f = self.facts
        return self.target.blocks_per_sm(f.registers, self.variant.num_warps, f.shared)

    def waves(self) -> float:
        """Programs of the smallest grid over the SMs (one wave: 1.0)."""
        return self.variant.min_programs() / self.target.sm_count

    def source_loops(self) -> tuple:
        """The run-time loops of the variant's source, its constexprs applied (what the
        accounting pairs with the compiled loops to count instructions)."""
        from gpn_scale.accounting import round_trips

        kernel = getattr(importlib.import_module(self.variant.module), self.variant.kernel)
        names = list(inspect.signature(kernel.fn).parameters)
        meta = {names[k[0]]: v for k, v in self.variant.constexprs.items() if k[0] < len(names)}
        return round_trips.loop_order(kernel, meta)

    def weight_load_bytes(self) -> int | None:
        operand = WEIGHT_OPERAND.get(self.variant.kernel)
        return self.facts.narrowest_load(operand) if operand else None

    def async_bytes_per_sm(self) -> int:
        """Bytes of asynchronous copies in flight per SM: a GEMM's shared-memory ring (its
        operand tiles, num_stages deep) times its programs per SM; 0 for the other kernels
        (plain loads, their shared memory only reductions')."""
        return (
            self.facts.shared * self.blocks_per_sm()
            if self.variant.kernel == "linear_kernel"
            else 0
        )

    def below_occupancy_bar(self) -> bool:
        return (
            self.blocks_per_sm() < MIN_PROGRAMS_PER_SM
            and self.async_bytes_per_sm() < MIN_ASYNC_BYTES_PER_SM
        )

    def occupancy_text(self) -> str:
        why = BELOW_OCCUPANCY_BAR.get(self.variant.kernel)
        state = (
            "meets the occupancy bar now: remove it from BELOW_OCCUPANCY_BAR"
            if why and not self.below_occupancy_bar()
            else f"below the occupancy bar ({why})"
            if why
            else "below the occupancy bar"
        )
        return (
            f"{self.blocks_per_sm()} program(s) per SM, {self.async_bytes_per_sm() // 1024} KB "
            f"of async copies in flight per SM (bar: {MIN_PROGRAMS_PER_SM} programs or "
            f"{MIN_ASYNC_BYTES_PER_SM // 1024} KB): {state}"
        )

    def problems(self) -> list[str]:
        f, v, t = self.facts, self.variant, self.target
        out = []
        if not f.ok:
            out.append(f"compile error: {f.error.splitlines()[0] if f.error else '?'}")
            return out
        if f.spill_stores or f.spill_loads or f.stack:
            out.append(
                f"spills {f.spill_stores}/{f.spill_loads} B per thread, stack {f.stack} B "
                f"({f.registers} registers, {v.num_warps} warps)"
            )
        if f.shared > t.smem_per_block:
            out.append(f"shared memory {f.shared} B over {t.name}'s {t.smem_per_block} B")
        if self.blocks_per_sm() < 1:
            out.append("does not fit on an SM")
        if self.case.shipped and v.kernel != "linear_kernel":
            # (tiny test shapes: LLVM unrolls one-trip loops; only the shipped sizes matter)
            compiled, source = len(f.loop_instructions), len(self.source_loops())
            if compiled != source:
                out.append(
                    f"{compiled} loops compiled, {source} in the source: the accounting "
                    "cannot count the instructions its programs issue (round_trips.loop_order)"
                )
        if self.case.shipped and v.phases <= set(STEP_PHASES):
            if self.below_occupancy_bar() != (v.kernel in BELOW_OCCUPANCY_BAR):
                out.append(self.occupancy_text())
        step_gemm = v.kernel == "linear_kernel" and v.phases <= set(STEP_PHASES)
        if self.case.shipped and step_gemm:
            from gpn_scale.ops.gpn_step.gemm import wave_fill

            fill = wave_fill(v.min_programs(), t.sm_count)
            split = v.constexprs.get("SPLITS", 1) > 1
            if fill < MIN_WAVE_FILL and (split or v.min_programs() < t.sm_count):
                out.append(
                    f"step GEMM grid of {v.min_programs()} programs fills {fill:.0%} of its "
                    f"waves on {t.sm_count} SMs ({', '.join(sorted(v.names))})"
                )
            width = self.weight_load_bytes()
            if width is not None and width < 16:
                out.append(
                    f"weights read {width} bytes at a time, not 16 (a row stride that is "
                    f"not 16-byte aligned? {', '.join(sorted(v.names))})"
                )
        return out


def build_rows(
    cases: Iterable[Case],
    targets: Iterable[Target],
    jobs: int,
    cache: FactsCache,
    triton_cache: str | None = None,
    progress: bool = True,
    kernels: set[str] | None = None,
    what_if: dict[str, dict[str, int]] | None = None,
) -> list[Row]:
    per_case: list[tuple[Case, Target, Variant]] = []
    for case, target in ((c, t) for c in cases for t in targets):
        launches = record_launches(case, target.sm_count)
        if kernels:
            launches = [
                r for r in launches if r.kernel is not None and r.kernel.fn.__name__ in kernels
            ]
        if what_if:
            launches = [
                dataclasses.replace(r, meta={**r.meta, **what_if.get(r.kernel.fn.__name__, {})})
                if r.kernel is not None
                else r
                for r in launches
            ]
        per_case += [(case, target, v) for v in specialise(launches, target)]
    facts = compile_variants([(v, t) for _, t, v in per_case], jobs, cache, triton_cache, progress)
    return [Row(c, t, v, facts[(v.key, t.name)]) for c, t, v in per_case]


def table(rows: list[Row]) -> str:
    lines = [
        "| case | target | kernel | variants | launches | warps | regs | spill st/ld B | "
        "stack B | smem B | CTAs/SM | programs / SMs | weight load B | MMA |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str, str], list[Row]] = defaultdict(list)
    for r in rows:
        groups[(r.case.label, r.target.name, r.label)].append(r)
    for (case, target, label), rs in groups.items():
        ok = all(r.facts.ok for r in rs)
        regs = [r.facts.registers for r in rs]
        spills = (max(r.facts.spill_stores for r in rs), max(r.facts.spill_loads for r in rs))
        occ = [r.blocks_per_sm() for r in rs]
        waves = min(r.waves() for r in rs)
        programs = min(r.variant.min_programs() for r in rs)
        weight = [w for w in (r.weight_load_bytes() for r in rs) if w is not None]
        mma = (
            "wgmma"
            if any(r.facts.wgmma for r in rs)
            else ("mma.sync" if any(r.facts.mma_sync for r in rs) else "-")
        )
        lines.append(
            f"| {case} | {target} | {label}{'' if ok else ' **FAILED**'} | {len(rs)} | "
            f"{sum(r.variant.launches for r in rs)} | {rs[0].variant.num_warps} | "
            f"{_span(regs)} | {spills[0]}/{spills[1]} | {max(r.facts.stack for r in rs)} | "
            f"{max(r.facts.shared for r in rs)} | {_span(occ)} | "
            f"{programs} / {rs[0].target.sm_count} ({waves:.2f}) | "
            f"{_span(weight) if weight else '-'} | {mma} |"
        )
    return "\n".join(lines) + "\n"


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def problems(rows: list[Row]) -> list[str]:
    return [f"{r.case.label} {r.target.name} {r.label}: {p}" for r in rows for p in r.problems()]


def known_below_occupancy(rows: list[Row]) -> list[str]:
    """The shipped sequential kernels below the occupancy bar that BELOW_OCCUPANCY_BAR
    names (reported, not failed), one line per kernel and target."""
    seen: dict[tuple[str, str], str] = {}
    for r in rows:
        v = r.variant
        if r.case.shipped and v.phases <= set(STEP_PHASES) and r.below_occupancy_bar():
            seen.setdefault((v.kernel, r.target.name), r.occupancy_text())
    return [f"{kernel} {target}: {text}" for (kernel, target), text in sorted(seen.items())]


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
        with contextlib.suppress(ValueError):
            parsed = int(value)
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


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
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
        args.json.write_text(
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
                        **dataclasses.asdict(r.facts),
                    )
                    for r in rows
                ],
                indent=1,
                default=str,
            )
        )
    known = known_below_occupancy(rows)
    if known:
        print("\nknown, below the occupancy bar (issue 34):")
        for line in known:
            print(f"  - {line}")
    if found:
        print("\nproblems:")
        for p in found:
            print(f"  - {p}")
        return 1 if args.gate else 0
    print("no compile errors, no spills, shared memory within limits")
    return 0


if __name__ == "__main__":
    # Compiled kernels, never the interpreter's (the kernels module is imported later).
    os.environ.pop("TRITON_INTERPRET", None)
    sys.exit(main())
