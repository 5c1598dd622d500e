"""accounting/round_trips.py: the dependent global round trips of a Triton program, read from
its source (what the launch accounting's latency model charges), on kernels small enough to
count by hand, and on the CUDA backend's own kernels at the shipped sizes."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import triton
import triton.language as tl

from gpn_scale.accounting import round_trips


@triton.jit
def _load_store(X, Y):
    tl.store(Y, tl.load(X) + 1.0)


@triton.jit
def _two_levels(X, Y, Z):
    a = tl.load(X)
    tl.store(Y, a)  # a barrier: the next load may alias Y
    b = tl.load(Z)
    tl.store(Y + 1, b)


@triton.jit
def _hoisted(X, Y, Z):
    a = tl.load(X)
    c = a * 2.0  # arithmetic: the next load is hoisted above it
    b = tl.load(Z)
    tl.store(Y, c + b)


@triton.jit
def _loop(X, Y, N, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, N, BLOCK):
        acc += tl.load(X + i + tl.arange(0, BLOCK))
    tl.store(Y + tl.arange(0, BLOCK), acc)


@triton.jit
def _constexpr_loop(X, Y, N: tl.constexpr, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, N, BLOCK):
        acc += tl.load(X + i + tl.arange(0, BLOCK))
    tl.store(Y + tl.arange(0, BLOCK), acc)


@triton.jit
def _pipelined(X, Y, N, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.range(0, N, BLOCK, num_stages=3):
        acc += tl.load(X + i + tl.arange(0, BLOCK))
    tl.store(Y + tl.arange(0, BLOCK), acc)


@triton.jit
def _unrolled(X, Y, SPLITS: tl.constexpr):
    acc = 0.0
    for s in tl.static_range(SPLITS):
        acc += tl.load(X + s)
    tl.store(Y, acc)


@triton.jit
def _helper(P):
    return tl.load(P) * 2.0


@triton.jit
def _branches(X, Y, H: tl.constexpr, WIDE: tl.constexpr):
    h = tl.program_id(1)
    if h >= H:  # a run-time branch: per program class
        tl.store(Y, tl.load(X))
    else:
        a = _helper(X)
        tl.store(Y, a)
        b = tl.load(X + 1)
        tl.store(Y + 1, b)
        if WIDE:  # constexpr: resolved at compile time, no block boundary
            c = tl.load(X + 2)
            tl.store(Y + 2, c)


@triton.jit
def _derived_branch(X, Y, H: tl.constexpr):
    h = tl.program_id(1)
    if (h * 2) % 3 == 0:  # not a plain comparison of the id: no path may be assumed
        tl.store(Y, tl.load(X))
    else:
        tl.store(Y, _helper(X) + tl.load(X + 1))


@triton.jit
def _loop_per_program(X, Y):
    h = tl.program_id(1)
    acc = 0.0
    for i in range(h):  # the trip count is the program's
        acc += tl.load(X + i)
        tl.store(Y, acc)


@triton.jit
def _pick(P, first):
    if first > 0:
        tl.store(P, 1.0)
    else:
        tl.store(P + 1, 2.0)


@triton.jit
def _both_arms(X):
    _pick(X, 1)
    _pick(X, 0)


def trips(kernel, args, meta=None, pid=(0, 0, 0)):
    return round_trips.round_trips(kernel, args, meta or {}, pid)


def test_a_load_then_its_store_is_one_round_trip_and_a_store_is_a_barrier():
    assert trips(_load_store, (None, None)) == 1
    assert trips(_two_levels, (None, None, None)) == 2
    assert trips(_hoisted, (None, None, None)) == 1


def test_loop_iterations_each_wait_unless_the_loop_is_pipelined_or_unrolled():
    assert trips(_loop, (None, None, 64), {"BLOCK": 8}) == 8
    assert trips(_loop, (None, None, 640), {"BLOCK": 8}) == 80  # extrapolated past 3
    # pipelined: the first iteration's load waits, the next ones were issued ahead
    assert trips(_pipelined, (None, None, 64), {"BLOCK": 8}) == 1
    assert trips(_unrolled, (None, None), {"SPLITS": 5}) == 1


def test_branches_on_the_program_id_give_classes_and_constexpr_ones_no_boundary():
    assert trips(_branches, (None, None), {"H": 2, "WIDE": False}, pid=(0, 2, 0)) == 1
    assert trips(_branches, (None, None), {"H": 2, "WIDE": False}, pid=(0, 1, 0)) == 2
    assert trips(_branches, (None, None), {"H": 2, "WIDE": True}, pid=(0, 1, 0)) == 3


def test_programs_along_axis_1_walk_each_path_once_and_equal_every_programs_own_walk():
    def walked(kernel, meta, n):
        before = set(round_trips._CACHE)
        programs = round_trips.programs_along_axis1(kernel, (None, None), meta, n)
        own = [round_trips.analyse(kernel, (None, None), meta, (0, j, 0)) for j in range(n)]
        assert [(p.trips, p.loop_executions) for p in programs] == [
            (p.trips, p.loop_executions) for p in own
        ]
        return len(set(round_trips._CACHE) - before)

    # h < H and h >= H: two paths over 7 programs, two walks
    assert walked(_branches, {"H": 3, "WIDE": True}, 7) == 2
    # a decision on a value computed from the id, or a loop as long as the id: every program
    assert walked(_derived_branch, {"H": 3}, 6) == 6
    assert walked(_loop_per_program, {}, 5) == 5
    one = round_trips.analyse(_load_store, (None, None), {})
    assert not one.branches_on_pid1 and one.followed_by(9)


def _line_of(kernel, text: str) -> int:
    """The file line of the first line of `kernel`'s source that holds `text`."""
    lines, start = inspect.getsourcelines(kernel.fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_a_program_skips_the_arms_of_run_time_branches_it_never_takes():
    meta = {"H": 2, "WIDE": False}
    ffn = round_trips.analyse(_branches, (None, None), meta, (0, 2, 0))
    head = round_trips.analyse(_branches, (None, None), meta, (0, 1, 0))
    path = inspect.getsourcefile(_branches.fn)
    body = _line_of(_branches, "tl.store(Y, tl.load(X))")
    orelse = (_line_of(_branches, "a = _helper(X)"), _line_of(_branches, "tl.store(Y + 2, c)"))
    assert ffn.skipped == ((path, *orelse),)
    assert head.skipped == ((path, body, body),)  # WIDE's arm: the compiler's, not the walk's
    # an arm one call of a helper takes and another skips is the program's
    assert round_trips.analyse(_both_arms, (None,), {}).skipped == ()


def test_loop_executions_line_up_with_the_loops_the_compiler_keeps():
    p = round_trips.analyse(_loop, (None, None, 64), {"BLOCK": 8})
    assert p.loop_executions == (8.0,)
    assert round_trips.loop_order(_unrolled, {"SPLITS": 5}) == ()
    assert len(round_trips.loop_order(_branches, {"H": 2, "WIDE": True})) == 0
    # A loop of constexpr bounds that runs once is compiled as straight code; twice, a loop.
    assert round_trips.loop_order(_constexpr_loop, {"N": 3840, "BLOCK": 4096}) == ()
    assert len(round_trips.loop_order(_constexpr_loop, {"N": 3840, "BLOCK": 1024})) == 1
    assert len(round_trips.loop_order(_constexpr_loop, {"BLOCK": 1024})) == 1  # N unknown


KERNELS_FILE = """
import triton
import triton.language as tl


@triton.jit
def first_kernel(X):
    tl.store(X, 1.0)


@triton.jit
def second_kernel(X, FIRST: tl.constexpr, LAST: tl.constexpr):
    for s in tl.static_range(FIRST, LAST):
        tl.store(
            X + s,
            tl.load(X + 8 + s) * 2.0,
        )
"""


def _import_file(path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "edit",
    [
        # a function added above: at second_kernel's line the file now has another function
        lambda src: src.replace(
            "@triton.jit", "@triton.jit\ndef added(X):\n    pass\n\n\n@triton.jit", 1
        ),
        # a line added inside second_kernel: same name, its statements moved down
        lambda src: src.replace("    for s in", "    X = X + 1\n    for s in"),
    ],
    ids=["function added above", "function edited"],
)
def test_a_kernel_file_edited_after_its_import(tmp_path, edit):
    """inspect reads a function's source from its file as it is now: edited since the import
    (and before the walk first parsed it), the walk priced another function's program (a
    device-check smoke once failed on a `static_range(FIRST, LAST)` of a kernel it was never
    given). A compiled kernel is walked over Triton's own copy of its source, the one it
    compiles; a function without one is refused."""
    from triton.runtime.jit import JITFunction

    from gpn_scale.accounting import round_trips_walk

    path = tmp_path / "kernels_under_edit.py"
    path.write_text(KERNELS_FILE)
    name = f"kernels_under_edit_{abs(hash(str(tmp_path)))}"
    plain = _import_file(path, name + "_plain").second_kernel
    plain = getattr(plain, "fn", plain)  # the Python function: no copy of its source
    second = _import_file(path, name + "_compiled").second_kernel
    compiled = JITFunction(getattr(second, "fn", second))  # what triton.jit makes on a GPU
    path.write_text(edit(KERNELS_FILE))
    meta = {"FIRST": 0, "LAST": 2}
    assert round_trips.analyse(compiled, (None,), meta).trips == 2
    with pytest.raises(round_trips_walk.SourceChanged, match="kernels_under_edit.py changed"):
        round_trips.analyse(plain, (None,), meta)
    fresh = _import_file(path, name + "_edited")
    assert round_trips.analyse(fresh.second_kernel, (None,), meta).trips == 2  # imported anew


def test_makespan_places_programs_on_the_first_free_slot():
    assert round_trips.makespan((1.0, 1.0, 1.0), 2) == 2.0
    assert round_trips.makespan((3.0, 1.0, 1.0, 1.0), 2) == 3.0
    assert round_trips.makespan((), 4) == 0.0
    durations = round_trips.program_durations([2.0, 1.0], (3, 2), 1.0)
    assert durations == [2.0, 2.0, 2.0, 1.0, 1.0, 1.0]  # axis 0 fastest


@pytest.fixture(scope="module")
def shipped_launches():
    from gpn_scale.accounting import gpu_compile

    # (the memory backward's item queue is walked as its plain twin, as the accounting does)
    return [
        gpu_compile.plain_twin(r) or r
        for r in gpu_compile.record_launches(gpu_compile.Case("gpn_m_130m", 16))
    ]


def test_the_backends_kernels_at_the_shipped_size(shipped_launches):
    """The memory backward's d_value loop is software-pipelined: one round trip for its first
    block (unpipelined, one per block: 16 blocks of 16 at dv 256), one for the loads before
    it and one for those after it (every load of the epilogue before its first store); the
    forward's two loops (M0's 128 key rows in blocks of 16, the history's t rows in blocks
    of 8) are pipelined too: one round trip each and one for the loads before them (at the
    chunk's first step the history is empty: its loop never runs); the read norm's row sums one
    (its 3,840 columns in one block, once per row); the row kernel one block of d (2,496) per
    pass; a split-K sum one."""
    from gpn_scale.ops.gpn_step import cuda_shared

    dv = 256  # gpn_m_130m
    back_blocks = dv // cuda_shared.MEMORY_BACKWARD_BLOCK_DV
    counts: dict[str, int] = {}
    for rec in shipped_launches:
        if rec.kernel is None or rec.kernel.fn.__name__ == "linear_kernel":
            continue
        per = round_trips.round_trips(rec.kernel, rec.args, rec.meta, (0, 0, 0))
        counts[rec.name] = max(counts.get(rec.name, 0), per)
    assert counts["memory/FFN backward 0"] == 3
    backward = next(r for r in shipped_launches if r.name == "memory/FFN backward 0")
    unpipelined = round_trips.round_trips(
        backward.kernel, backward.args, {**backward.meta, "STAGES": 1}, (0, 0, 0)
    )
    program = round_trips.analyse(backward.kernel, backward.args, backward.meta, (0, 0, 0))
    assert unpipelined - program.trips == back_blocks - 1
    # the d_value loop reported with its stages and the iterations whose loads came ahead
    # (what pricing.pipeline_waits charges when a body issues faster than a round trip)
    assert (backward.meta["STAGES"], back_blocks - 1) in program.pipelined
    key_blocks = 128 // cuda_shared.MEMORY_FORWARD_ROW_BLOCK  # gpn_m_130m's d_key
    forwards = [r for r in shipped_launches if r.name == "memory/FFN 0"]
    first = round_trips.analyse(forwards[0].kernel, forwards[0].args, forwards[0].meta, (0, 0, 0))
    assert first.trips == 2  # the loads before the loops, M0's first block
    forward = forwards[-1]  # the chunk's last step: its history spans the chunk but one row
    tau = forward.args[forward.kernel.arg_names.index("tau")]
    history_blocks = -(-tau // cuda_shared.MEMORY_FORWARD_HISTORY_BLOCK)
    assert history_blocks > 1
    unpipelined = round_trips.round_trips(
        forward.kernel, forward.args, {**forward.meta, "STAGES": 1}, (0, 0, 0)
    )
    program = round_trips.analyse(forward.kernel, forward.args, forward.meta, (0, 0, 0))
    assert counts["memory/FFN 0"] == program.trips == 3
    assert unpipelined - program.trips == (key_blocks - 1) + (history_blocks - 1)
    stages = forward.meta["STAGES"]
    assert {(stages, key_blocks - 1), (stages, history_blocks - 1)} <= set(program.pipelined)
    assert counts["read norm sums 0"] == 1
    assert counts["row backward"] <= 5 and counts["fuse-gate GEMM (split-K sum)"] == 1
    ffn = [
        round_trips.round_trips(rec.kernel, rec.args, rec.meta, (0, 15, 0))
        for rec in shipped_launches
        if rec.name == "memory/FFN backward 0"
    ]
    assert max(ffn) <= 2  # an FFN program (h >= H): one load level, its stores
