"""Dependent global-memory round trips of one program of a Triton kernel, read from its source.

A kernel whose programs are few per SM and do little arithmetic runs at the latency of its
memory accesses, not at the bandwidth: each load whose result the program must wait for
before it can issue the next load costs one trip to L2 or HBM (~1 us loaded). The launch
accounting (`gpu_model`) charges such a kernel

    waves x round trips per program x loaded latency  (+ its bytes at the bandwidth)

and this module counts the round trips from the kernel's own code, with the launch's
arguments, so that a change to a kernel changes its price without anyone re-counting.

The rules are those of an in-order GPU warp and of Triton's compiler:
- a `tl.load` issues as soon as its address is known and no earlier store or block boundary
  holds it back; its value is ready one round trip later;
- arithmetic waits for its operands but later loads may be hoisted above it (the compiler
  schedules loads early within a basic block);
- a `tl.store` waits for the value it stores, and no later load is hoisted above it (the
  pointers may alias): it is a barrier;
- a loop iteration, a branch taken at run time (a condition on anything but constexpr
  parameters) and the end of the program are basic-block boundaries: the warp has waited
  there for everything the block used;
- a loop whose loads Triton software-pipelines (`tl.range(..., num_stages>=2)`, or a loop
  containing `tl.dot` in a kernel compiled with more than one stage) has the next
  iteration's loads in flight while the current one computes: after its first iteration
  a load's value is ready at the iteration's start. That holds only while an iteration
  takes at least a round trip over the stages - 1 iterations in flight: the loop's stages
  and later iterations are reported (`Program.pipelined`) so that the pricing can charge
  a faster body the difference (`pricing.pipeline_waits`);
- `tl.static_range` is unrolled: its iterations are one block;
- `@triton.jit` helpers are inlined.

Branches whose condition is not known (it depends on loaded values) count their longer arm.
Nothing here runs the kernel: loop trip counts and branch conditions come from the launch's
scalar arguments, its constexprs and the program id.

Here: a launch's program analysed (`analyse`, `cached_analysis`), the kernel's loops in the
compiled code's order (`loop_order`) and the programs' schedule over an SM's slots
(`program_durations`, `makespan`). The walk over the source itself: round_trips_walk.py.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpn_scale.accounting.round_trips_walk import (
    UNKNOWN,
    _call_name,
    _compare,
    _constexpr_params,
    _is_jit,
    _names,
    _parsed,
    _python_fn,
    _Value,
    _Walk,
)


# --------------------------------------------------------------------------- public
def _scalar(a: Any) -> Any:
    """A launch argument as the walk sees it: ints, floats and bools by value, the rest
    (tensors, pointers) unknown."""
    if isinstance(a, bool) or isinstance(a, (int, float)):
        return a
    return UNKNOWN


@dataclass(frozen=True)
class Program:
    """What one program of a launch does, read from the source: its dependent round trips
    and how many times each of the kernel's loops (`loop_order`) runs its body."""

    trips: int
    loop_executions: tuple[float, ...]
    branches_on_pid1: bool = False  # programs along grid axis 1 may differ
    # per loop of `loop_order`, its stages if software-pipelined (else 0) and its
    # iterations past the first of each entry (those whose loads were issued ahead)
    pipelined: tuple[tuple[int, float], ...] = ()
    # Its path's decisions on tl.program_id(1), each a plain comparison of the id, with their
    # outcomes; None where one is not (see `programs_along_axis1`).
    pid1_trace: tuple[tuple[tuple[type, Any, bool], bool], ...] | None = ()
    # The arms of run-time branches it never takes, as (source file, first line, last line):
    # their instructions outside loops are not its (kernel_costs.skipped_instructions).
    skipped: tuple[tuple[str, int, int], ...] = ()

    def followed_by(self, pid1: int) -> bool:
        """Whether program `pid1` of the same launch takes this program's path: every
        decision on the id along it comes out the same for `pid1` (the walk reads the id
        nowhere else that changes what it counts), so it is this program."""
        if self.pid1_trace is None:
            return False
        for (op, other, pid_left), outcome in self.pid1_trace:
            taken = _compare(op, pid1, other) if pid_left else _compare(op, other, pid1)
            if taken is UNKNOWN or bool(taken) != outcome:
                return False
        return True


def analyse(
    kernel: Any, args: Sequence[Any], meta: dict[str, Any], pid: Sequence[int] = (0, 0, 0)
) -> Program:
    """Program `pid` of one launch (`kernel[grid](*args, **meta)`), walked over the kernel's
    source (see the module docstring)."""
    fn = _python_fn(kernel)
    stages = int(meta.get("num_stages", 3))
    walk = _Walk(pid, stages)
    node, _ = _parsed(fn)
    names = [p.arg for p in node.args.args]
    values = [_Value(_scalar(a)) for a in args]
    kwargs = {k: _Value(_scalar(v)) for k, v in meta.items() if k in names}
    walk.call_function(fn, values, kwargs, top=True)
    order = loop_order(kernel, meta)
    loops = tuple(walk.executions.get(key, 0.0) for key in order)
    pipelined = tuple(
        (walk.pipelined[key][0], walk.executions.get(key, 0.0) - walk.pipelined[key][1])
        if key in walk.pipelined
        else (0, 0.0)
        for key in order
    )
    trace = tuple(walk.pid1_trace) if walk.pid1_trace is not None else None
    trips = max(walk.state.barrier, walk.state.stall)
    skipped = tuple(sorted(walk.arms_skipped - walk.arms_taken))
    return Program(
        trips,
        loops,
        walk.branches_on_pid1,
        pipelined=pipelined,
        pid1_trace=trace,
        skipped=skipped,
    )


def round_trips(
    kernel: Any, args: Sequence[Any], meta: dict[str, Any], pid: Sequence[int] = (0, 0, 0)
) -> int:
    """Dependent global round trips of program `pid` of one launch."""
    return analyse(kernel, args, meta, pid).trips


def loop_order(kernel: Any, meta: dict[str, Any] | None = None) -> tuple[tuple[str, int], ...]:
    """The kernel's run-time loops (`range` / `tl.range`; `tl.static_range` is unrolled) as
    (function, line), in the order the compiled code has them: source order, a helper's
    loops where it is called (helpers are inlined), and none of a branch on constexprs
    (`meta`) that the compiler drops."""
    fn = _python_fn(kernel)
    known = tuple(sorted((k, v) for k, v in (meta or {}).items() if isinstance(v, (bool, int))))
    return _loop_order(fn, known)


@functools.cache
def _loop_order(fn: Any, known: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, int], ...]:
    out: list[tuple[str, int]] = []
    values = dict(known)

    def walk(f: Any, node: ast.AST, constexprs: set[str]) -> None:
        if isinstance(node, ast.If) and _names(node.test) <= constexprs:
            taken = _static_condition(node.test, values)
            if taken is not None:
                for stmt in node.body if taken else node.orelse:
                    walk(f, stmt, constexprs)
                return
        if isinstance(node, ast.For) and isinstance(node.iter, ast.Call):
            once = _static_trips(node.iter, constexprs, values) == 1  # LLVM drops the loop
            if _call_name(node.iter.func) != "static_range" and not once:
                out.append((f.__name__, node.lineno))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            target = _parsed(f)[1].get(node.func.id)
            if target is not None and _is_jit(target):
                helper = _python_fn(target)
                walk(helper, _parsed(helper)[0], set())  # its constexprs are not evaluated
        for child in ast.iter_child_nodes(node):
            walk(f, child, constexprs)

    node, _ = _parsed(fn)
    # a constexpr the launch leaves at its default has that value (as the walk takes it)
    params = node.args.args[len(node.args.args) - len(node.args.defaults) :]
    for param, default in zip(params, node.args.defaults):
        if isinstance(default, ast.Constant):
            values.setdefault(param.arg, default.value)
    walk(fn, node, set(_constexpr_params(node)))
    return tuple(out)


def _static_trips(call: ast.Call, constexprs: set[str], values: dict[str, Any]) -> int | None:
    """The trip count of a `range(...)` whose bounds are constexprs and literals (None: known
    only at run time)."""
    if call.keywords or not call.args or not all(_names(a) <= constexprs for a in call.args):
        return None
    try:
        bounds = [
            eval(compile(ast.Expression(a), "<range>", "eval"), {}, dict(values)) for a in call.args
        ]
        return len(range(*(int(b) for b in bounds)))
    except Exception:  # noqa: BLE001 - a name not given, or not plain Python: not evaluated
        return None


def _static_condition(test: ast.expr, values: dict[str, Any]) -> bool | None:
    """A condition on constexpr parameters, evaluated (None: not with these values)."""
    try:
        return bool(eval(compile(ast.Expression(test), "<constexpr>", "eval"), {}, dict(values)))
    except Exception:  # noqa: BLE001 - a name not given, or not plain Python: not evaluated
        return None


def cached_analysis(
    kernel: Any, args: Sequence[Any], meta: dict[str, Any], pid: Sequence[int] = (0, 0, 0)
) -> Program:
    """`analyse`, remembered per kernel, scalar arguments, meta-parameters and program
    id (a chunk launches the same kernel with the same scalars many times)."""
    key = (
        id(_python_fn(kernel)),
        tuple(None if _scalar(a) is UNKNOWN else _scalar(a) for a in args),
        tuple(sorted((k, v) for k, v in meta.items() if isinstance(v, (int, float, bool, str)))),
        tuple(pid),
    )
    hit = _CACHE.get(key)
    if hit is None:
        hit = _CACHE[key] = analyse(kernel, args, meta, pid)
    return hit


_CACHE: dict[tuple, Program] = {}


def programs_along_axis1(
    kernel: Any, args: Sequence[Any], meta: dict[str, Any], n: int
) -> list[Program]:
    """Programs (0, j, 0) for j < n of one launch, walked once per path: a program that
    takes an already walked program's path (`Program.followed_by`) is that program. The
    memory kernels' heads and FFN blocks are two paths over ~30 programs."""
    first = cached_analysis(kernel, args, meta, (0, 0, 0))
    if not first.branches_on_pid1:
        return [first] * n
    walked = [first]
    out = [first]
    for j in range(1, n):
        program = next((p for p in walked if p.followed_by(j)), None)
        if program is None:
            program = cached_analysis(kernel, args, meta, (0, j, 0))
            walked.append(program)
        out.append(program)
    return out


def program_durations(trips: Sequence[float], grid: Sequence[int], seconds: float) -> list[float]:
    """Each program's time (its class's round trips x `seconds`), in launch order (grid axis
    0 fastest): `trips` holds one count per value of axis 1, taken to hold along the others
    (rows, split-K ranges); the kernels branch on axis 1 (heads against FFN blocks)."""
    g = tuple(grid) + (1,) * (3 - len(grid))
    per = list(trips) or [0]
    return [per[j] * seconds for _ in range(g[2]) for j in range(g[1]) for _ in range(g[0])]


@functools.lru_cache(maxsize=4096)
def makespan(durations: tuple[float, ...], slots: int) -> float:
    """The time the last of `durations` (programs in launch order) ends when each starts on
    the first of `slots` resident places to free up (the hardware's block scheduler)."""
    import heapq

    if not durations:
        return 0.0
    if len(durations) <= slots:
        return max(durations)
    free = [0.0] * slots
    for d in durations:
        t = heapq.heappop(free)
        heapq.heappush(free, t + d)
    return max(free)
