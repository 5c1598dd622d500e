"""What the compile gate finds (accounting/gpu_compile.py): a kernel whose offsets pass
2**31 in 32 bits at the widest shapes (recorded launches, nothing compiled), and per
compiled variant of a case on a target (`Row`): a compile error, a spill or a stack frame,
shared memory over the target's limit, a shipped sequential kernel below the occupancy bar,
or a step GEMM that leaves SMs idle or reads its weights narrowly; with the table of them."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from gpn_scale.accounting.gpu_compile_cases import Case, Target, plain_twin, record_launches
from gpn_scale.accounting.gpu_compile_facts import Facts, FactsCache, compile_variants
from gpn_scale.accounting.gpu_compile_variants import Variant, specialise

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
# None now: the block flush, the last one, met it once its products came from the chunk's
# Gram matrices (8 warps at <= 128 registers, two programs per SM).
BELOW_OCCUPANCY_BAR: dict[str, str] = {}
WEIGHT_OPERAND = {"linear_kernel": "W"}
# Step GEMMs (by launch name, without the layer) that still read a float32 A operand under
# bf16 weights, and why: the GEMM casts every A tile it loads, and each of its column tiles
# loads A again (L2 -> SM bytes). Reported on every gate, not failed; a GEMM leaves this
# list when its producer writes A in bf16 (the gate then fails until it is removed).
FLOAT32_A_OPERANDS: dict[str, str] = {
    "first-step input GEMM": "a chunk's first state is the carry, in float32 (1 step of C)",
    "fuse-gate GEMM": "its row RMS sums A's float32 squares while A streams through the K loop",
    "input dy W^T": "dY is a float32 adjoint: the bias gradient sums it (chunk.py)",
    "predict-gate dy W^T": "dY is a float32 adjoint: the bias gradient sums it (chunk.py)",
    "fuse-gate dy W^T": "dYfg is a float32 adjoint: the bias gradient sums it (chunk.py)",
}
# Loops the accounting prices as software-pipelined (round_trips.py: a `tl.range(...,
# num_stages>=2)` loop has the next iteration's loads in flight), by kernel: the operands
# Triton must then copy with cp.async at the shipped sizes. A change that stops the
# pipeliner (a register-hungry loop, a Triton that declines) fails the gate instead of
# leaving the accounting to price round trips the GPU still makes.
PIPELINED_OPERANDS = {
    "memory_backward_kernel": ("m0_base", "tile_du", "u_base"),
    "memory_forward_kernel": ("kh_base", "m0_base", "uh_base"),
    "softmax_xent_kernel": ("base",),
}


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

    def kernel(self):
        return getattr(importlib.import_module(self.variant.module), self.variant.kernel)

    def meta(self) -> dict:
        """The variant's constexprs by parameter name."""
        names = list(inspect.signature(self.kernel().fn).parameters)
        return {names[k[0]]: v for k, v in self.variant.constexprs.items() if k[0] < len(names)}

    def source_loops(self) -> tuple:
        """The run-time loops of the variant's source, its constexprs applied (what the
        accounting pairs with the compiled loops to count instructions)."""
        from gpn_scale.accounting import round_trips

        return round_trips.loop_order(self.kernel(), self.meta())

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

    def float32_a_problems(self) -> list[str]:
        """A step GEMM under bf16 weights reading a float32 A not in FLOAT32_A_OPERANDS, or
        one listed there that reads bf16 A now."""
        roles = {re.sub(r" \d+$", "", name) for name in self.variant.names}
        listed = sorted(roles & set(FLOAT32_A_OPERANDS))
        if self.variant.signature.get("A") == "*fp32":
            return [] if listed else [f"reads a float32 A operand ({', '.join(sorted(roles))})"]
        return [f"reads bf16 A now: remove {r!r} from FLOAT32_A_OPERANDS" for r in listed]

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
        # (tiny test shapes: LLVM unrolls one-trip loops; only the shipped sizes matter; the
        # memory backward's item queue is priced as its plain twin, compiled here beside it)
        if (
            self.case.shipped
            and v.kernel != "linear_kernel"
            and not self.meta().get("RESERVED_SMS")
        ):
            compiled, source = len(f.loop_instructions), len(self.source_loops())
            if compiled != source:
                out.append(
                    f"{compiled} loops compiled, {source} in the source: the accounting "
                    "cannot count the instructions its programs issue (round_trips.loop_order)"
                )
        if self.case.shipped:
            loaded = [o for o in PIPELINED_OPERANDS.get(v.kernel, ()) if o in f.loads]
            plain = [o for o in loaded if o not in f.async_operands]
            if plain:
                out.append(
                    f"its pipelined loop loads {', '.join(plain)} without cp.async: not "
                    "software-pipelined as the accounting prices it (PIPELINED_OPERANDS)"
                )
        if self.case.shipped and v.phases <= set(STEP_PHASES):
            if self.below_occupancy_bar() != (v.kernel in BELOW_OCCUPANCY_BAR):
                out.append(self.occupancy_text())
        step_gemm = v.kernel == "linear_kernel" and v.phases <= set(STEP_PHASES)
        if self.case.shipped and step_gemm:
            from gpn_scale.ops.gpn_step.gemm import MAX_SPLITS, wave_fill

            fill = wave_fill(v.min_programs(), t.sm_count)
            splits = self.meta().get("SPLITS", 1)
            # At the split cap a grid has too few column tiles to fill a wave: more splits
            # would move more partials than the SMs they fill gain (the wide panels leave
            # the rest to the reverse sweep's side work: gemm.WIDE_PANEL_N).
            capped = splits >= MAX_SPLITS
            if (
                fill < MIN_WAVE_FILL
                and not capped
                and (splits > 1 or v.min_programs() < t.sm_count)
            ):
                out.append(
                    f"step GEMM grid of {v.min_programs()} programs fills {fill:.0%} of its "
                    f"waves on {t.sm_count} SMs ({', '.join(sorted(v.names))})"
                )
            if v.signature.get("W") == "*bf16":
                out += self.float32_a_problems()
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
        launches = record_launches(case, target.sm_count, target.arch)
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
        launches += [t for r in launches if (t := plain_twin(r)) is not None]
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


def known_float32_a(rows: list[Row]) -> list[str]:
    """The shipped step GEMMs that read a float32 A operand under bf16 weights, as
    FLOAT32_A_OPERANDS names them (reported, not failed): one line per GEMM."""
    seen: set[str] = set()
    for r in rows:
        v = r.variant
        bf16 = v.signature.get("W") == "*bf16" and v.signature.get("A") == "*fp32"
        if r.case.shipped and v.kernel == "linear_kernel" and v.phases <= set(STEP_PHASES) and bf16:
            seen |= {re.sub(r" \d+$", "", n) for n in v.names} & set(FLOAT32_A_OPERANDS)
    return [f"{name}: {FLOAT32_A_OPERANDS[name]}" for name in sorted(seen)]


def known_below_occupancy(rows: list[Row]) -> list[str]:
    """The shipped sequential kernels below the occupancy bar that BELOW_OCCUPANCY_BAR
    names (reported, not failed), one line per kernel and target."""
    seen: dict[tuple[str, str], str] = {}
    for r in rows:
        v = r.variant
        if r.case.shipped and v.phases <= set(STEP_PHASES) and r.below_occupancy_bar():
            seen.setdefault((v.kernel, r.target.name), r.occupancy_text())
    return [f"{kernel} {target}: {text}" for (kernel, target), text in sorted(seen.items())]
