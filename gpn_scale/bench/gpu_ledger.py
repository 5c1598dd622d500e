"""Where a GPN+M step's time goes on the GPU, launch by launch: the device check's ledger.

    python -m gpn_scale.bench.gpu_ledger --config gpn_m_130m --batches 64,128 --out DIR
    python -m gpn_scale.bench.gpu_ledger --device cpu --config tiny --batches 2 --out DIR

One training step of a one-chunk window (T = chunk size) runs with CUDA graphs off and every
kernel launch recorded with its arguments (`ops/launch.py`): one forward chunk, one reverse
chunk, the decode's cross-entropy. Then, per launch role ("input GEMM 0", "memory/FFN
backward 0", ...; the memory kernels at their chunk's first, middle and last step):

- **in sequence**: the chunk's launches replayed in their order, back to back on the GPU
  (the host enqueues them behind a sleep kernel, so its binding time is not in the figures),
  with an event between each two: every launch's time in the caches the real step gives it;
- **alone**: each distinct launch replayed after a write of twice the L2 over a scratch
  buffer, so weights that fit in L2 do not flatter it (the real step streams ~200 MB of
  weights between two uses of any of them);

beside the bytes and FLOPs the launch accounting counts for it, achieved GB/s and its share
of the measured copy bandwidth, TFLOP/s, programs per SM, registers / spills / shared memory
as that machine's Triton compiled it, and the accounting's own prediction for it.

**What-ifs** (`what_ifs`): the launch settings the accounting chose between without a GPU
(`WHAT_IFS`), each timed alone beside the shipped one at the same steps, so that one device
run says whether its choice holds.

On CPU (Triton's interpreter, tiny configs) the same code runs as a smoke test; its times
mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpn_scale.models.gpn import GPN, GPNConfig, load_model_config
from gpn_scale.ops import launch as launches_
from gpn_scale.ops.execution import execution

# Launches whose cost depends on the step within the chunk (its history grows): kept at the
# chunk's first, middle and last step.
STEP_DEPENDENT = ("memory/FFN", "memory backward block flush")
SLEEP_CYCLES_PER_LAUNCH = 200_000  # ~0.1 ms at 2 GHz: more than the host's binding per launch


@dataclass
class Recorded:
    """One launch of the recorded step, with what it was given."""

    index: int
    launch: launches_.Launch
    tau: int | None  # the step within the chunk, for the memory kernels

    @property
    def role(self) -> str:
        return self.launch.name


def _gemm_plan_on_sm80(r: Recorded) -> tuple[dict[str, int], tuple[int, ...]] | None:
    """The input GEMM's dy W^T as the plan for sm_80 tiles it (128-wide panels: the wide ones
    are Hopper's, `gemm.WIDE_PANEL_N`), as a change of meta-parameters and grid; None for
    another GEMM, or where that plan needs more split partials than the launch's workspace
    holds."""
    from gpn_scale.ops.gpn_step import gemm

    if not r.role.startswith("input dy W^T"):
        return None
    rec = r.launch
    given = dict(zip(inspect.signature(rec.kernel.fn).parameters, rec.args))
    a, M, N, K = given["A"], given["M"], given["N"], given["K"]
    ieee = rec.meta["PRECISION"] == "ieee"
    with execution(assumed_arch=80):
        plan = gemm.gemm_plan(M, N, K, a, rec.meta["SPLIT_K1"], ieee)
    if plan.splits > rec.meta["SPLITS"]:
        return None
    return plan.meta(), plan.grid(M, N)


def _other_row_block(r: Recorded) -> tuple[dict[str, int], tuple[int, ...]]:
    """The memory forward walking M0 in the row block it does not ship with on this Triton
    (the plain one, or the one its item queue takes before Triton 3.8:
    cuda_forward.row_block), at the launch's d_value, with that block's stages, same grid."""
    from gpn_scale.ops.gpn_step import cuda_forward, cuda_shared

    dv, meta = r.launch.meta["BLOCK_DV"], r.launch.meta
    bf16_reads = meta["STAGES"] == cuda_shared.MEMORY_FORWARD_STAGES_BF16_READS
    plain = cuda_shared.MEMORY_FORWARD_ROW_BLOCK
    queued = cuda_shared.MEMORY_FORWARD_QUEUE_ROW_BLOCK_BEFORE_3_8
    other = queued if meta["BLOCK_R"] == cuda_forward.rows_a_block(plain, dv) else plain
    rows = cuda_forward.rows_a_block(other, dv)
    return {"BLOCK_R": rows, "STAGES": cuda_forward.stages(other, bf16_reads)}, r.launch.grid


# A what-if: a change of a launch's meta-parameters, or a function of the launch giving one
# and the grid it needs (None: not for this launch).
WhatIf = dict[str, int] | Callable[[Recorded], tuple[dict[str, int], tuple[int, ...]] | None]
# Per kernel, the alternatives to its shipped launch settings that the accounting priced
# worse (issue 34; ops/gpn_step/cuda_shared.py and gemm.py say why each was chosen). Every
# one is a launch setting only: the kernel computes the same product with any of them (a
# GEMM's split ranges add in another order).
WHAT_IFS: dict[str, tuple[tuple[str, WhatIf], ...]] = {
    "memory_backward_kernel": (
        ("16 value columns, 3 stages", {"BLOCK_DV": 16, "STAGES": 3}),
        ("4 stages", {"STAGES": 4}),
        ("8 warps", {"num_warps": 8}),
        ("d_value loop not pipelined", {"STAGES": 1}),
    ),
    "memory_forward_kernel": (
        ("3 stages", {"STAGES": 3}),
        ("4 stages", {"STAGES": 4}),  # shipped at 16 rows; at 8 (before 3.8) the one left
        ("5 stages", {"STAGES": 5}),
        ("loops not pipelined", {"STAGES": 1}),
        ("the other row block (16 or 8 rows of M0)", _other_row_block),
        ("16 history rows a block", {"BLOCK_J": 16}),
    ),
    "linear_kernel": (("128-wide panels (the sm_80 plan)", _gemm_plan_on_sm80),),
}


def record_step(cfg: GPNConfig, batch: int, device: torch.device, bf16: bool) -> list[Recorded]:
    """One training step over one chunk (T = chunk size) with CUDA graphs off; every kernel
    launch recorded with its arguments (kept alive by the records)."""
    cfg = cfg.replace(cuda_graphs=False, step_backend="cuda")
    torch.manual_seed(0)
    model = GPN(cfg).to(device)
    T = cfg.engine.chunk_size
    tokens = torch.randint(0, cfg.vocab_size, (batch, T), device=device)
    anywhere = device.type != "cuda"  # the decode's Triton kernel in the interpreter too
    with (
        launches_.recording(keep_args=True) as records,
        execution(triton_anywhere=anywhere),
        torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and device.type == "cuda"),
    ):
        model(tokens).loss.backward()
    _sync(device)
    out = []
    for i, rec in enumerate(records):
        if rec.kernel is None:  # an ATen copy or a collective the backend noted
            continue
        out.append(Recorded(i, rec, _tau(rec)))
    return out


def _tau(rec: launches_.Launch) -> int | None:
    """The step argument of a memory kernel's launch (by parameter name), else None."""
    if not rec.name.startswith(STEP_DEPENDENT):
        return None
    import inspect

    names = list(inspect.signature(rec.kernel.fn).parameters)
    for key in ("tau", "b0"):
        if key in names:
            i = names.index(key)
            return int(rec.args[i]) if i < len(rec.args) else None
    return None


def distinct(recorded: list[Recorded]) -> list[Recorded]:
    """One launch per role, grid and meta-parameters; for the memory kernels one at the
    chunk's first, middle and last step."""
    groups: dict[tuple, list[Recorded]] = defaultdict(list)
    for r in recorded:
        meta = tuple(sorted((k, v) for k, v in r.launch.meta.items() if not hasattr(v, "shape")))
        groups[(r.role, tuple(r.launch.grid), meta)].append(r)
    out = []
    for members in groups.values():
        if members[0].tau is None:
            out.append(members[0])
            continue
        by_tau = sorted(members, key=lambda r: r.tau or 0)
        picks = {0: by_tau[0], 1: by_tau[len(by_tau) // 2], 2: by_tau[-1]}
        seen: set[int] = set()
        for r in picks.values():
            if r.index not in seen:
                seen.add(r.index)
                out.append(r)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _launch(r: Recorded) -> Any:
    rec = r.launch
    return rec.kernel[rec.grid](*rec.args, **rec.meta)


class Timer:
    """Seconds of each of a list of callables run back to back: CUDA events between them,
    enqueued behind a sleep so the host's launch costs stay out; on CPU the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def each(self, fns: Sequence[Callable[[], Any]], before: Callable[[], Any] | None = None):
        if self.device.type != "cuda":
            out = []
            for fn in fns:
                if before is not None:
                    before()
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return out
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * len(fns))]
        torch.cuda._sleep(SLEEP_CYCLES_PER_LAUNCH * (len(fns) + (len(fns) if before else 0)))
        for i, fn in enumerate(fns):
            if before is not None:
                before()
            events[2 * i].record()
            fn()
            events[2 * i + 1].record()
        torch.cuda.synchronize(self.device)
        return [events[2 * i].elapsed_time(events[2 * i + 1]) / 1e3 for i in range(len(fns))]


def l2_flush(device: torch.device) -> Callable[[], None]:
    """A write of twice the GPU's L2 over a scratch buffer (a CPU: a small one)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        size = 2 * int(getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20)
    else:
        size = 1 << 16
    scratch = torch.empty(size // 4, dtype=torch.float32, device=device)

    def flush() -> None:
        scratch.fill_(1.0)

    return flush


def compiled_facts(compiled: Any) -> dict[str, Any]:
    """Registers, spills and shared memory of a kernel as this machine's Triton compiled it
    (what `kernel[grid](...)` returned), plus its PTX's cp.async operands and instruction
    counts (accounting/gpu_compile.py's readers); {} in the interpreter."""
    if compiled is None or not hasattr(compiled, "metadata"):
        return {}
    out: dict[str, Any] = {
        "registers": getattr(compiled, "n_regs", None),
        "spills": getattr(compiled, "n_spills", None),
        "shared": getattr(compiled.metadata, "shared", None),
        "num_warps": getattr(compiled.metadata, "num_warps", None),
    }
    ptx = getattr(compiled, "asm", {}).get("ptx")
    if ptx:
        import inspect

        from gpn_scale.accounting import gpu_compile

        out["instructions"], out["loop_instructions"] = gpu_compile.ptx_instructions(ptx)
        path = inspect.getsourcefile(fn) if (fn := getattr(compiled, "_fn", None)) else None
        if path:
            asynchronous: set[str] = set()
            gpu_compile.parse_ptx_loads(ptx, gpu_compile.source_operands(path), path, asynchronous)
            out["async_operands"] = sorted(asynchronous)
    return out


def ledger(
    cfg: GPNConfig,
    batch: int,
    device: torch.device,
    bf16: bool = True,
    repeats: int = 5,
    copy_bytes_per_s: float | None = None,
    config_name: str = "",
    seq_len: int | None = None,
) -> list[dict[str, Any]]:
    """The ledger's rows at `batch` (see the module docstring): one per distinct launch,
    with its time in sequence and alone, its counts, rates and compiled facts. A role's
    share of the step: `us_per_time_step` (its launches in sequence over the chunk's steps)
    and `s_per_step`, that times `seq_len` (a training step's window; every launch of the
    CUDA path recurs per step or per chunk)."""
    recorded = record_step(cfg, batch, device, bf16)
    timer = Timer(device)
    # In sequence: the whole step's launches in order (twice: the first warms the caches).
    fns = [(lambda r=r: _launch(r)) for r in recorded]
    timer.each(fns)
    in_seq = timer.each(fns)
    per_role: dict[str, list[float]] = defaultdict(list)
    for r, s in zip(recorded, in_seq):
        per_role[r.role].append(s)
    C = cfg.engine.chunk_size
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 1
    )
    flush = l2_flush(device)
    rows = []
    for r in distinct(recorded):
        compiled = _launch(r)  # warm, and what this machine's Triton compiled
        if compiled is not None:
            with contextlib.suppress(AttributeError, TypeError):
                compiled._fn = r.launch.kernel.fn  # its source, for the PTX's load operands
        replay = functools.partial(_launch, r)
        alone = statistics.median(timer.each([replay] * repeats, before=flush))
        rec = r.launch
        programs = math.prod(rec.grid)
        count = len(per_role[r.role])
        row: dict[str, Any] = {
            "config": config_name or cfg.name,
            "batch": batch,
            "role": r.role,
            "phase": rec.phase,
            "kernel": rec.kernel.fn.__name__,
            "grid": list(rec.grid),
            "tau": r.tau,
            "programs": programs,
            "programs_per_sm": programs / sms,
            "launches_per_chunk": count,
            "bytes": rec.bytes,
            "flops": rec.flops,
            "alone_s": alone,
            "in_sequence_s": statistics.mean(per_role[r.role]),
            # the role's share of one time step (its launches over the chunk's C steps)
            "us_per_time_step": sum(per_role[r.role]) / C * 1e6,
            "s_per_step": sum(per_role[r.role]) / C * (seq_len or C),
            "gbytes_per_s": rec.bytes / alone / 1e9 if alone > 0 else None,
            "tflops": rec.flops / alone / 1e12 if alone > 0 else None,
            **compiled_facts(compiled),
        }
        if copy_bytes_per_s:
            row["copy_share"] = rec.bytes / alone / copy_bytes_per_s if alone > 0 else None
        rows.append(row)
    return rows


def what_ifs(
    cfg: GPNConfig,
    batch: int,
    device: torch.device,
    bf16: bool = True,
    repeats: int = 5,
    config_name: str = "",
) -> list[dict[str, Any]]:
    """Each launch of a kernel in `WHAT_IFS` (at its chunk's first, middle and last step)
    timed alone with its shipped settings and with each alternative, side by side: one row
    per launch and setting, with `vs_shipped` (its time over the shipped one's) and what
    this machine's Triton compiled for it."""
    recorded = [r for r in record_step(cfg, batch, device, bf16) if r.launch.kernel is not None]
    timer = Timer(device)
    flush = l2_flush(device)
    rows: list[dict[str, Any]] = []
    for r in distinct(recorded):
        name = r.launch.kernel.fn.__name__
        if name not in WHAT_IFS:
            continue
        settings: list[tuple[str, WhatIf]] = [("shipped", {}), *WHAT_IFS[name]]
        timed = []
        for label, what_if in settings:
            grid = r.launch.grid
            if callable(what_if):
                got = what_if(r)
                if got is None:
                    continue
                change, grid = got
            else:
                change = what_if
            meta = {**r.launch.meta, **change}
            alt = Recorded(r.index, dataclasses.replace(r.launch, meta=meta, grid=grid), r.tau)
            compiled = _launch(alt)  # compile and warm
            alone = statistics.median(
                timer.each([functools.partial(_launch, alt)] * repeats, before=flush)
            )
            timed.append((label, change, alone, compiled))
        if len(timed) == 1:  # no alternative for this launch
            continue
        shipped = timed[0][2]
        for label, change, alone, compiled in timed:
            rows.append(
                {
                    "config": config_name or cfg.name,
                    "batch": batch,
                    "role": r.role,
                    "kernel": name,
                    "tau": r.tau,
                    "setting": label,
                    "meta": {k: v for k, v in r.launch.meta.items() if isinstance(v, int)} | change,
                    "alone_s": alone,
                    "vs_shipped": alone / shipped if shipped > 0 else None,
                    **compiled_facts(compiled),
                }
            )
    return rows


def what_ifs_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| config | B | role | tau | setting | alone us | vs shipped | regs | spills | warps |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['batch']} | {r['role']} | {_f(r['tau'], 'd')} | "
            f"{r['setting']} | {r['alone_s'] * 1e6:.1f} | {_f(r['vs_shipped'], '.2f')} | "
            f"{_f(r.get('registers'), 'd')} | {_f(r.get('spills'), 'd')} | "
            f"{_f(r.get('num_warps'), 'd')} |"
        )
    return "\n".join(lines) + "\n"


def by_role(rows: list[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Per (config, batch), one entry per launch role (its distinct launches merged: the
    role's time per step in sequence, the mean of its launches alone), largest first."""
    out: dict[tuple[str, int], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        roles = out[(r["config"], r["batch"])]
        if r["role"] not in roles:
            roles[r["role"]] = {**r, "_alone": [r["alone_s"]]}
        else:
            roles[r["role"]]["_alone"].append(r["alone_s"])
    merged = {}
    for key, roles in out.items():
        entries = []
        for entry in roles.values():
            alone = entry.pop("_alone")
            entries.append({**entry, "alone_s": statistics.mean(alone)})
        merged[key] = sorted(entries, key=lambda e: -e["s_per_step"])
    return merged


def device_facts(rows: list[dict[str, Any]], target_name: str = "sm_90") -> dict[str, Any]:
    """kernels.json of this machine's compiled kernels, from the ledger's rows (what
    `gpu_model --against` prices the run's own kernels with)."""
    from gpn_scale.accounting import gpu_compile

    target = gpu_compile.TARGETS[target_name]
    variants: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        if r.get("registers") is None:
            continue
        key = (r["kernel"], r["registers"], r.get("shared"), r.get("num_warps"))
        v = variants.setdefault(
            key,
            {
                "kernel": r["kernel"],
                "names": [],
                "cases": [],
                "num_warps": r.get("num_warps") or 4,
                "registers": r["registers"],
                "shared": r.get("shared") or 0,
                "spill_stores": r.get("spills") or 0,
                "spill_loads": 0,
                "async_operands": r.get("async_operands", []),
                "instructions": r.get("instructions", 0),
                "loop_instructions": r.get("loop_instructions", []),
            },
        )
        v["blocks_per_sm"] = target.blocks_per_sm(v["registers"], v["num_warps"], v["shared"])
        if r["role"] not in v["names"]:
            v["names"].append(r["role"])
        case = f"{r['config']} bf16 B={r['batch']}"
        if case not in v["cases"]:
            v["cases"].append(case)
    return {"variants": list(variants.values())}


def predicted_per_role(
    cfg: GPNConfig, batch: int, seq_len: int, ceilings=None, facts=None
) -> dict[str, float]:
    """The accounting's seconds per training step of each launch role (graphs on)."""
    from gpn_scale.accounting import step_model

    acc = step_model.account(cfg, batch, seq_len, facts=facts)
    return step_model.predict(acc, ceilings or "h200", graphs=True, cfg=cfg).per_role_seconds


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| config | B | role | tau | grid | programs/SM | regs | spills | smem B | launches "
        "/ chunk | alone us | in sequence us | us / time step | GB/s | copy share | TFLOP/s "
        "| MB | GFLOP |",
        "|" + "---|" * 18,
    ]
    for r in sorted(rows, key=lambda r: (r["config"], r["batch"], -r["us_per_time_step"])):
        lines.append(
            f"| {r['config']} | {r['batch']} | {r['role']} | {_f(r['tau'], 'd')} | "
            f"{'x'.join(map(str, r['grid']))} | {r['programs_per_sm']:.2f} | "
            f"{_f(r.get('registers'), 'd')} | {_f(r.get('spills'), 'd')} | "
            f"{_f(r.get('shared'), 'd')} | {r['launches_per_chunk']} | "
            f"{r['alone_s'] * 1e6:.1f} | {r['in_sequence_s'] * 1e6:.1f} | "
            f"{r['us_per_time_step']:.1f} | {_f(r['gbytes_per_s'], '.0f')} | "
            f"{_f(r.get('copy_share'), '.0%')} | {_f(r['tflops'], '.1f')} | "
            f"{r['bytes'] / 1e6:.2f} | {r['flops'] / 1e9:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _f(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for ledger.json/.md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="gpn_m_130m")
    parser.add_argument("--batches", default="64,128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        print(f"gpu_ledger: --out {args.out} is a file; give a directory", file=sys.stderr)
        return 2
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        print(
            f"gpu_ledger: --batches {args.batches!r}: expected integers like 64,128",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cfg = load_model_config(args.config)
    rows: list[dict[str, Any]] = []
    alternatives: list[dict[str, Any]] = []
    for b in batches:
        rows += ledger(cfg, b, device, not args.fp32, args.repeats, config_name=args.config)
        alternatives += what_ifs(cfg, b, device, not args.fp32, args.repeats, args.config)
        blob = {"rows": rows, "what_ifs": alternatives}
        (args.out / "ledger.json").write_text(json.dumps(blob, indent=1))
    text = markdown(rows) + "\n" + what_ifs_markdown(alternatives)
    (args.out / "ledger.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
