"""What the compiler made of a kernel, read back from its output (accounting/gpu_compile.py):
registers, spills and stack from the ptxas log; from the PTX, the width of every global load
per source operand (`.loc` lines name the source line of each `tl.load`) and the
instructions of the kernel and of each of its loops."""

from __future__ import annotations

import ast
import functools
import os
import re
from collections import defaultdict
from pathlib import Path

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
    return dict(_load_operands(Path(path).read_text()))


@functools.lru_cache(maxsize=16)
def _load_operands(text: str) -> dict[int, str]:
    # Keyed on the file's text: a compile process reads the same kernel file for each of its
    # variants (parsing it took ~1/7 of a variant's compile time in the gate).
    out: dict[int, str] = {}
    for node in ast.walk(ast.parse(text)):
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
    wanted = source_file_numbers(ptx, source_file)
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


def _instructions_and_loops(ptx: str) -> tuple[list[str], list[bool], list[tuple[int, int]]]:
    """The PTX's lines (stripped), which are instructions, and each loop's (first, last)
    line: a label and the backward branch to it, sorted by where they start."""
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
    return lines, is_instr, spans


_LOC = re.compile(r"^\.loc\s+(\d+)\s+(\d+)\s+\d+(?:,.*?\binlined_at\s+(\d+)\s+(\d+))?")


def line_instructions(ptx: str, source_file: str) -> list[list[int]]:
    """Instructions outside every loop by the lines of `source_file` they stand on (their
    `.loc` line and each call site it was inlined at, outermost first), as [count, *lines]
    rows; those of other files, or before any `.loc`, left out. What a program skips of them
    when it does not take a branch arm: kernel_costs.skipped_instructions.

    A helper inlined into a helper shows as a chain of `.loc` directives, each inlined at
    the line before it (`.loc 1371 at 1719`, `.loc 58 at 1371`, `.loc 42 at 58`); a later one
    inlined at a line of the chain goes on from there."""
    wanted = source_file_numbers(ptx, source_file)
    lines, is_instr, spans = _instructions_and_loops(ptx)
    in_loop = [False] * len(lines)
    for a, b in spans:
        in_loop[a : b + 1] = [True] * (b + 1 - a)
    counts: dict[tuple[int, ...], int] = defaultdict(int)
    chain: tuple[int, ...] = ()
    for i, t in enumerate(lines):
        m = _LOC.match(t)
        if m:
            here = int(m.group(2)) if int(m.group(1)) in wanted and int(m.group(2)) else 0
            at = int(m.group(4)) if m.group(3) and int(m.group(3)) in wanted else 0
            if not here:
                chain = ()
            elif not at:
                chain = (here,)
            elif at in chain:
                chain = chain[: chain.index(at) + 1] + (here,)
            else:
                chain = (at, here)
        elif is_instr[i] and not in_loop[i] and chain:
            counts[chain] += 1
    return [[n, *chain] for chain, n in sorted(counts.items())]


def source_file_numbers(ptx: str, source_file: str) -> set[int]:
    """The numbers the PTX's `.file` directives give `source_file` (its `.loc`s name it so)."""
    return {
        int(m.group(1))
        for m in re.finditer(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.M)
        if same_file(m.group(2), source_file)
    }


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file; where one is not there to ask, whether they are
    spelled alike."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a == b


def ptx_instructions(ptx: str) -> tuple[int, list[int]]:
    """(instructions in the PTX, each loop's own instructions), loops found by their
    backward branches and listed by where they start; a nested loop's instructions are its
    own, not its parent's."""
    lines, is_instr, spans = _instructions_and_loops(ptx)
    own = []
    for a, b in spans:
        inner = sum(
            sum(is_instr[c : d + 1])
            for c, d in spans
            if a < c and d < b and not any(a < e < c and d < f < b for e, f in spans)
        )
        own.append(sum(is_instr[a : b + 1]) - inner)
    return sum(is_instr), own
