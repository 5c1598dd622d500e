"""The walk behind round_trips.py: one program of a Triton kernel, statement by statement over
its source, with what is known of each name (its value, when known, and the round trip after
which it is ready), the level below which loads cannot issue and how far the warp has waited;
loops simulated for a few iterations then extrapolated, branches resolved where their
condition is known, `@triton.jit` helpers inlined (the rules: round_trips.py's docstring)."""

from __future__ import annotations

import ast
import dis
import functools
import inspect
import linecache
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

UNKNOWN = object()  # a value not known without running the kernel
_MAX_SIMULATED_ITERATIONS = 3  # then extrapolated from the last iteration's cost


@dataclass
class _Value:
    """What the walk knows of a name: its Python value (when known) and the round trip after
    which it is ready (0: at once)."""

    known: Any = UNKNOWN
    ready: int = 0
    from_pid1: bool = False  # derived from tl.program_id(1): a branch on it splits programs
    is_pid1: bool = False  # tl.program_id(1) itself
    # A comparison of tl.program_id(1) with a value not derived from it: (operator, that
    # value, whether the program id is on the left), to evaluate for another program.
    pid1_test: tuple[type, Any, bool] | None = None


@dataclass
class _State:
    barrier: int = 0  # loads cannot issue before this level (stores, block boundaries)
    stall: int = 0  # the warp has waited this far (the highest ready level it has used)

    def boundary(self) -> None:
        self.barrier = max(self.barrier, self.stall)

    def use(self, ready: int) -> None:
        self.stall = max(self.stall, ready)


@dataclass
class _Frame:
    names: dict[str, _Value] = field(default_factory=dict)
    constexprs: set[str] = field(default_factory=set)  # names whose branches resolve at compile
    returned: _Value | None = None
    fn_name: str = ""
    path: str = ""  # its source file, and the file line of its source's first line
    first_line: int = 1


class _Return(Exception):
    pass


class SourceChanged(RuntimeError):
    """A kernel's file changed on disk after it was imported: its source there is no longer
    the code that runs, so the walk would price another function's (or version's) program."""


# Triton's own copy of a compiled @triton.jit function's source lines, read when it was
# defined (the source it compiles), by Python function (`_python_fn` notes it).
_DEFINED_SOURCE: dict[Any, tuple[str, ...]] = {}


@functools.cache
def _parsed(fn: Any) -> tuple[ast.FunctionDef, dict[str, Any]]:
    lines = _DEFINED_SOURCE.get(fn) or _file_source(fn)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef))
    return node, fn.__globals__


def _file_source(fn: Any) -> tuple[str, ...]:
    """fn's source lines as its file has them now, checked against fn's code: inspect reads
    the file at the line the code object recorded, so an edit to the file since the import
    hands the walk another function, or fn's lines moved. Each name fn's code loads or
    stores must stand in the file where the code says it does (an edit that moves none of
    them, text added after the last, goes unseen)."""
    lines, _ = inspect.getsourcelines(fn)
    code = fn.__code__
    text = linecache.getlines(code.co_filename)
    for ins in dis.get_instructions(code):
        where = ins.positions
        if not (
            isinstance(ins.argval, str)
            and (ins.opcode in dis.hasname or ins.opcode in dis.haslocal)
            and where is not None
            and where.lineno is not None
            and where.lineno == where.end_lineno
            and where.col_offset is not None
            and where.end_col_offset is not None
        ):
            continue
        line = text[where.lineno - 1].encode() if where.lineno <= len(text) else b""
        found = line[where.col_offset : where.end_col_offset].decode(errors="replace")
        if not found.endswith(ins.argval):  # `tl.exp` for the attribute exp
            raise SourceChanged(
                f"round trips: {code.co_filename} changed since {fn.__name__} was imported: "
                f"its code has {ins.argval} at line {where.lineno}, the file now "
                f"{found.strip()!r}; run again in a new process"
            )
    return tuple(lines)


def _python_fn(kernel: Any) -> Any:
    """The Python function behind a @triton.jit object (or the function itself)."""
    fn = getattr(kernel, "fn", kernel)
    if fn in _DEFINED_SOURCE:  # (called for every launch the accounting prices)
        return fn
    raw, code = getattr(kernel, "raw_src", None), getattr(fn, "__code__", None)
    # (the copy starts where fn's code does: its first decorator's line)
    first = getattr(kernel, "starting_line_number", None)
    if raw and code is not None and first == code.co_firstlineno:
        _DEFINED_SOURCE[fn] = tuple(raw)
    return fn


def _is_jit(obj: Any) -> bool:
    """A @triton.jit function (compiled or, under TRITON_INTERPRET, interpreted)."""
    return inspect.isfunction(getattr(obj, "fn", None))


class _Walk:
    def __init__(self, pid: Sequence[int], stages: int) -> None:
        self.pid = tuple(pid) + (0,) * (3 - len(pid))
        self.stages = stages
        self.state = _State()
        self.prefetch = False  # inside a pipelined loop past its first iteration
        # (function, line) of each `for` loop -> its body's executions in the program (the
        # iterations not simulated counted too)
        self.executions: dict[tuple[str, int], float] = {}
        # ... and of each software-pipelined one, its stages and how often it is entered
        self.pipelined: dict[tuple[str, int], tuple[int, float]] = {}
        self.weight = 1.0
        self.branches_on_pid1 = False
        # Each decision on tl.program_id(1) along this program's path, as (test, outcome);
        # None once one is not a plain comparison of the id (then no other program may be
        # taken to follow the same path: see round_trips.programs_along_axis1).
        self.pid1_trace: list[tuple[tuple[type, Any, bool], bool]] | None = []
        # Arms of run-time branches this program skipped / took, as (file, first line, last
        # line): its instructions leave out those of an arm it never takes (kernel_costs).
        self.arms_skipped: set[tuple[str, int, int]] = set()
        self.arms_taken: set[tuple[str, int, int]] = set()

    # ------------------------------------------------------------------ functions
    def call_function(
        self, fn: Any, args: list[_Value], kwargs: dict[str, _Value], top: bool = False
    ) -> _Value:
        node, module_globals = _parsed(fn)
        frame = _Frame(
            fn_name=fn.__name__,
            path=inspect.getsourcefile(fn) or "",
            first_line=fn.__code__.co_firstlineno,
        )
        params = node.args.args
        defaults = node.args.defaults
        first_default = len(params) - len(defaults)
        constexprs = _constexpr_params(node)
        for i, p in enumerate(params):
            if i < len(args):
                value = args[i]
            elif p.arg in kwargs:
                value = kwargs[p.arg]
            elif i >= first_default:
                value = _Value(self._literal(defaults[i - first_default]))
            else:
                value = _Value()
            frame.names[p.arg] = value
        frame.constexprs |= constexprs
        self.globals = module_globals
        try:
            self.block(node.body, frame)
        except _Return:
            pass
        if top:
            self.state.boundary()
        return frame.returned or _Value()

    @staticmethod
    def _literal(node: ast.expr) -> Any:
        try:
            return ast.literal_eval(node)
        except ValueError:
            return UNKNOWN

    # ----------------------------------------------------------------- statements
    def block(self, body: Iterable[ast.stmt], frame: _Frame) -> None:
        for stmt in body:
            self.statement(stmt, frame)

    def statement(self, stmt: ast.stmt, frame: _Frame) -> None:
        if isinstance(stmt, ast.Assign):
            value = self.expr(stmt.value, frame)
            for target in stmt.targets:
                self.assign(target, value, frame)
        elif isinstance(stmt, ast.AugAssign):
            current = self.expr(stmt.target, frame)
            value = self.expr(stmt.value, frame)
            known = _fold(type(stmt.op), current.known, value.known)
            self.state.use(max(current.ready, value.ready))
            pid1 = current.from_pid1 or value.from_pid1
            self.assign(stmt.target, _Value(known, max(current.ready, value.ready), pid1), frame)
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            self.assign(stmt.target, self.expr(stmt.value, frame), frame)
        elif isinstance(stmt, ast.Expr):
            self.expr(stmt.value, frame)
        elif isinstance(stmt, ast.If):
            self.branch(stmt, frame)
        elif isinstance(stmt, ast.For):
            self.loop(stmt, frame)
        elif isinstance(stmt, ast.Return):
            frame.returned = self.expr(stmt.value, frame) if stmt.value is not None else _Value()
            raise _Return
        elif isinstance(stmt, (ast.Pass, ast.Assert)):
            pass
        else:
            raise NotImplementedError(f"round trips: statement {type(stmt).__name__} not modelled")

    def assign(self, target: ast.expr, value: _Value, frame: _Frame) -> None:
        if isinstance(target, ast.Name):
            frame.names[target.id] = value
        elif isinstance(target, (ast.Tuple, ast.List)):
            parts = value.known if isinstance(value.known, tuple) else None
            for i, t in enumerate(target.elts):
                part = parts[i] if parts else _Value(UNKNOWN, value.ready, value.from_pid1)
                self.assign(t, part, frame)
        # subscript / attribute targets do not occur in Triton kernels

    def _decided_on_pid1(self, value: _Value) -> None:
        """A decision (a branch taken, an arm chosen, a loop's trip count) on `value`."""
        if not value.from_pid1:
            return
        self.branches_on_pid1 = True
        if self.pid1_trace is not None and value.pid1_test and value.known is not UNKNOWN:
            self.pid1_trace.append((value.pid1_test, bool(value.known)))
        else:
            self.pid1_trace = None

    def branch(self, stmt: ast.If, frame: _Frame) -> None:
        cond = self.expr(stmt.test, frame)
        self._decided_on_pid1(cond)
        compile_time = _names(stmt.test) <= frame.constexprs
        if cond.known is not UNKNOWN:
            taken = stmt.body if cond.known else stmt.orelse
            if not compile_time:
                self.state.use(cond.ready)
                self.state.boundary()
                self._arms(taken, stmt.orelse if cond.known else stmt.body, frame)
            self.block(taken, frame)
            if not compile_time:
                self.state.boundary()
            return
        # Not known here: the longer arm (each walked from the same start).
        self.state.use(cond.ready)
        self.state.boundary()
        start = _State(self.state.barrier, self.state.stall)
        ends = []
        for arm in (stmt.body, stmt.orelse):
            self.state = _State(start.barrier, start.stall)
            self.block(arm, frame)
            self.state.boundary()
            ends.append(self.state)
        self.state = max(ends, key=lambda s: s.barrier)

    def _arms(self, taken: list[ast.stmt], skipped: list[ast.stmt], frame: _Frame) -> None:
        for arm, seen in ((taken, self.arms_taken), (skipped, self.arms_skipped)):
            if arm:
                last = max(s.end_lineno or s.lineno for s in arm)
                shift = frame.first_line - 1  # the parsed source starts at the file's first_line
                seen.add((frame.path, arm[0].lineno + shift, last + shift))

    def loop(self, stmt: ast.For, frame: _Frame) -> None:
        it = stmt.iter
        if not (isinstance(it, ast.Call) and isinstance(stmt.target, ast.Name)):
            raise NotImplementedError("round trips: only `for name in range(...)` is modelled")
        kind = _call_name(it.func)
        bounds = [self.expr(a, frame) for a in it.args]
        for b in bounds:
            self.state.use(b.ready)
            if b.from_pid1:  # a trip count that depends on the program: not a plain test
                self.branches_on_pid1 = True
                self.pid1_trace = None
        values = [b.known for b in bounds]
        if any(v is UNKNOWN for v in values):
            raise NotImplementedError(f"round trips: loop bounds of `{ast.unparse(it)}` unknown")
        indices = list(range(*values))
        var = stmt.target.id
        if kind == "static_range":  # unrolled: one block
            for i in indices:
                frame.names[var] = _Value(i)
                self.block(stmt.body, frame)
            return
        key = (frame.fn_name, stmt.lineno)
        self.executions[key] = self.executions.get(key, 0.0) + self.weight * len(indices)
        simulated = min(len(indices), _MAX_SIMULATED_ITERATIONS)
        outer_weight = self.weight
        if simulated:
            self.weight = outer_weight * len(indices) / simulated
        stages = self.stages
        explicit = isinstance(it.func, ast.Attribute)  # tl.range(..., num_stages=...)
        for kw in it.keywords:
            if kw.arg == "num_stages":
                stages = self.expr(kw.value, frame).known
        # Triton's pipeliner works on innermost loops: those with a tl.dot, or a tl.range
        # that asks for stages.
        innermost, has_dot = _loop_shape(stmt)
        asked = explicit and any(kw.arg == "num_stages" for kw in it.keywords)
        pipelined = innermost and isinstance(stages, int) and stages >= 2 and (has_dot or asked)
        if pipelined and indices:
            entered = self.pipelined.get(key, (0, 0.0))[1] + outer_weight
            self.pipelined[key] = (int(stages), entered)
        self.state.boundary()  # entering the loop
        costs: list[int] = []
        outer_prefetch = self.prefetch
        for n, i in enumerate(indices[:_MAX_SIMULATED_ITERATIONS]):
            before = self.state.barrier
            frame.names[var] = _Value(i)
            self.prefetch = pipelined and n > 0
            self.block(stmt.body, frame)
            self.state.boundary()
            costs.append(self.state.barrier - before)
        self.prefetch = outer_prefetch
        self.weight = outer_weight
        rest = len(indices) - len(costs)
        if rest > 0:
            self.state.barrier += rest * costs[-1]
            self.state.stall = max(self.state.stall, self.state.barrier)

    # ---------------------------------------------------------------- expressions
    def expr(self, node: ast.expr | None, frame: _Frame) -> _Value:
        if node is None:
            return _Value()
        if isinstance(node, ast.Constant):
            return _Value(node.value)
        if isinstance(node, ast.Name):
            if node.id in frame.names:
                return frame.names[node.id]
            return _Value(self.globals.get(node.id, UNKNOWN))
        if isinstance(node, ast.Attribute):
            base = self.expr(node.value, frame)
            attr: Any = UNKNOWN
            if base.known is not UNKNOWN and not _is_tensor_like(base.known):
                attr = getattr(base.known, node.attr, UNKNOWN)
            return _Value(attr, base.ready, base.from_pid1)
        if isinstance(node, ast.BinOp):
            a, b = self.expr(node.left, frame), self.expr(node.right, frame)
            self.state.use(max(a.ready, b.ready))
            folded = _fold(type(node.op), a.known, b.known)
            return _Value(folded, max(a.ready, b.ready), a.from_pid1 or b.from_pid1)
        if isinstance(node, ast.UnaryOp):
            a = self.expr(node.operand, frame)
            self.state.use(a.ready)
            return _Value(_unary(type(node.op), a.known), a.ready, a.from_pid1)
        if isinstance(node, ast.BoolOp):
            vals = [self.expr(v, frame) for v in node.values]
            known: Any = UNKNOWN
            if all(v.known is not UNKNOWN for v in vals):
                ks = [v.known for v in vals]
                known = all(ks) if isinstance(node.op, ast.And) else any(ks)
            return _Value(known, max(v.ready for v in vals), any(v.from_pid1 for v in vals))
        if isinstance(node, ast.Compare):
            vals = [self.expr(node.left, frame)] + [self.expr(c, frame) for c in node.comparators]
            known = UNKNOWN
            if all(v.known is not UNKNOWN for v in vals) and len(node.ops) == 1:
                known = _compare(type(node.ops[0]), vals[0].known, vals[1].known)
            self.state.use(max(v.ready for v in vals))
            test = None
            if len(node.ops) == 1 and known is not UNKNOWN:
                left, right = vals
                if left.is_pid1 and not right.from_pid1:
                    test = (type(node.ops[0]), right.known, True)
                elif right.is_pid1 and not left.from_pid1:
                    test = (type(node.ops[0]), left.known, False)
            from_pid1 = any(v.from_pid1 for v in vals)
            return _Value(known, max(v.ready for v in vals), from_pid1, pid1_test=test)
        if isinstance(node, ast.IfExp):
            cond = self.expr(node.test, frame)
            self._decided_on_pid1(cond)
            a, b = self.expr(node.body, frame), self.expr(node.orelse, frame)
            pid1 = cond.from_pid1 or a.from_pid1 or b.from_pid1
            if cond.known is not UNKNOWN:
                chosen = a if cond.known else b
                return _Value(chosen.known, max(cond.ready, chosen.ready), pid1)
            return _Value(UNKNOWN, max(cond.ready, a.ready, b.ready), pid1)
        if isinstance(node, ast.Subscript):
            base = self.expr(node.value, frame)
            index = self.expr(node.slice, frame)
            pid1 = base.from_pid1 or index.from_pid1
            return _Value(UNKNOWN, max(base.ready, index.ready), pid1)
        if isinstance(node, (ast.Tuple, ast.List)):
            parts = tuple(self.expr(e, frame) for e in node.elts)
            pid1 = any(p.from_pid1 for p in parts)
            return _Value(parts, max((p.ready for p in parts), default=0), pid1)
        if isinstance(node, ast.Slice):
            bounds = [self.expr(p, frame) for p in (node.lower, node.upper, node.step) if p]
            pid1 = any(p.from_pid1 for p in bounds)
            return _Value(UNKNOWN, max((p.ready for p in bounds), default=0), pid1)
        if isinstance(node, ast.Call):
            return self.call(node, frame)
        raise NotImplementedError(f"round trips: expression {type(node).__name__} not modelled")

    def call(self, node: ast.Call, frame: _Frame) -> _Value:
        name = _call_name(node.func)
        func = self.expr(node.func, frame)  # a method's receiver (x.to(...)) is an operand
        target = func.known if isinstance(node.func, ast.Name) else None
        args = [self.expr(a, frame) for a in node.args]
        kwargs = {k.arg: self.expr(k.value, frame) for k in node.keywords if k.arg}
        operands = [func, *args, *kwargs.values()]
        ready = max(v.ready for v in operands)
        if target is not None and _is_jit(target):  # a @triton.jit helper: inlined
            saved_globals = self.globals
            saved_state = self.state
            out = self.call_function(_python_fn(target), args, kwargs)
            self.globals = saved_globals
            assert self.state is saved_state
            return out
        if name == "load":
            issue = max(self.state.barrier, ready)
            self.state.use(ready)  # its address
            # In a pipelined loop past its first iteration the load was issued one iteration
            # ahead: its value is there when the iteration starts.
            prefetched = self.prefetch and issue == self.state.barrier
            return _Value(UNKNOWN, issue if prefetched else issue + 1)
        if name == "store" or name.startswith("atomic_"):
            self.state.use(ready)
            self.state.boundary()
            if name.startswith("atomic_"):
                return _Value(UNKNOWN, self.state.barrier + 1)
            return _Value()
        if name == "program_id":
            axis = args[0].known if args else kwargs["axis"].known
            return _Value(self.pid[axis], from_pid1=axis == 1, is_pid1=axis == 1)
        if name == "num_programs":
            return _Value(UNKNOWN)
        if name == "static_assert" or name == "device_print":
            return _Value()
        # Arithmetic, reductions, tl.dot, casts, tl.arange, tl.zeros...: ready with its
        # operands; the warp waits for them here (later loads may still be hoisted above).
        self.state.use(ready)
        known = UNKNOWN
        if name in ("cdiv",) and all(a.known is not UNKNOWN for a in args):
            known = -(-args[0].known // args[1].known)
        elif name in ("min", "minimum") and all(a.known is not UNKNOWN for a in args):
            known = min(a.known for a in args)
        elif name in ("max", "maximum") and all(a.known is not UNKNOWN for a in args):
            known = max(a.known for a in args)
        return _Value(known, ready, any(v.from_pid1 for v in operands))


def _is_tensor_like(x: Any) -> bool:
    return hasattr(x, "data_ptr") or hasattr(x, "dtype") and hasattr(x, "shape")


# What is read of a node's subtree, once per node: a walk visits the same statements for
# every program, step and launch it prices (ast nodes hash by identity).
@functools.cache
def _names(node: ast.AST) -> frozenset[str]:
    return frozenset(n.id for n in ast.walk(node) if isinstance(n, ast.Name)) - {"tl", "triton"}


@functools.cache
def _calls(node: ast.AST) -> tuple[ast.Call, ...]:
    return tuple(n for n in ast.walk(node) if isinstance(n, ast.Call))


@functools.cache
def _loop_shape(stmt: ast.For) -> tuple[bool, bool]:
    """Whether the loop is innermost (no loop in its body) and whether it has a tl.dot."""
    innermost = not any(isinstance(n, ast.For) for n in ast.walk(stmt) if n is not stmt)
    return innermost, any(_call_name(n.func) == "dot" for n in _calls(stmt))


@functools.cache
def _constexpr_params(node: ast.FunctionDef) -> frozenset[str]:
    return frozenset(
        p.arg
        for p in node.args.args
        if p.annotation is not None and "constexpr" in ast.unparse(p.annotation)
    )


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Div: lambda a, b: a / b,
    ast.BitAnd: lambda a, b: a & b,
    ast.BitOr: lambda a, b: a | b,
    ast.LShift: lambda a, b: a << b,
    ast.RShift: lambda a, b: a >> b,
}


def _fold(op: type, a: Any, b: Any) -> Any:
    if a is UNKNOWN or b is UNKNOWN or op not in _BINOPS:
        return UNKNOWN
    if not all(isinstance(x, (int, float, bool)) for x in (a, b)):
        return UNKNOWN
    try:
        return _BINOPS[op](a, b)
    except (ZeroDivisionError, TypeError):
        return UNKNOWN


def _unary(op: type, a: Any) -> Any:
    if a is UNKNOWN or not isinstance(a, (int, float, bool)):
        return UNKNOWN
    if op is ast.Not:
        return not a
    if op is ast.USub:
        return -a
    return a


_COMPARE = {
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
}


def _compare(op: type, a: Any, b: Any) -> Any:
    if op not in _COMPARE or not all(isinstance(x, (int, float, bool)) for x in (a, b)):
        return UNKNOWN
    return _COMPARE[op](a, b)
