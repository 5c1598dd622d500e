"""Programmatic dependent launch of the time steps' kernels (`engine.dependent_launch`): the
kernels' order of waiting and releasing, which launches ask for it (Hopper dry runs only, never
the interpreter or sm_80), the engine option, and what the accounting prices it at. What it
does on the GPU (bit-identical results, the time it saves) is the device check's
(bench/gpu_exactness.py, bench/gpu_throughput.py)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from gpn_scale.accounting import gpu_compile, pricing
from gpn_scale.accounting.kernel_record import Op
from gpn_scale.core.config import ConfigError
from gpn_scale.ops.execution import execution
from gpn_scale.ops.gpn_step import geometry
from gpn_scale.ops.gpn_step import triton_kernels as tk
from gpn_scale.ops.gpn_step.options import EngineOptions

SOURCE = Path(inspect.getsourcefile(tk)).read_text()
MODULE = ast.parse(SOURCE)
FUNCTIONS = {n.name: n for n in MODULE.body if isinstance(n, ast.FunctionDef)}
# What reads or writes memory a kernel before may write or read. `_prefetch_l2` does not: a
# prefetch into L2 changes no value.
MEMORY_OPS = {"load", "store"} | {f"atomic_{op}" for op in ("add", "cas", "xchg", "max", "min")}


def _calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _touches_memory(call: ast.Call, seen: frozenset[str] = frozenset()) -> bool:
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "tl":
        return f.attr in MEMORY_OPS
    if isinstance(f, ast.Name) and f.id in FUNCTIONS and f.id not in seen:
        return any(_touches_memory(c, seen | {f.id}) for c in _calls(FUNCTIONS[f.id]))
    return False


def _named(call: ast.Call, name: str) -> bool:
    return isinstance(call.func, ast.Name) and call.func.id == name


def _pdl_kernels() -> list[ast.FunctionDef]:
    """The kernels (not the `_` helpers) that take `PDL`."""
    return [
        f
        for f in FUNCTIONS.values()
        if not f.name.startswith("_") and any(a.arg == "PDL" for a in f.args.args)
    ]


def test_every_step_kernel_waits_for_its_predecessor_before_touching_memory():
    """A dependent launch may run beside the end of the kernel before it: nothing before its
    `_await_predecessor` may read or write memory (L2 prefetches aside), and it must release
    the next kernel after that wait (a release before it would let the kernel after next
    start while the one before this is still running)."""
    kernels = _pdl_kernels()
    names = {k.name for k in kernels}
    launched = {"linear_kernel", "linear_reduce_kernel", "memory_forward_kernel",
                "memory_backward_kernel", "memory_backward_flush_kernel", "rev_row_kernel",
                "rev_start_kernel", "read_norm_sums_kernel", "gated_residual_kernel",
                "l2n_relu_kernel"}  # fmt: skip
    assert launched <= names, f"step kernels without PDL: {sorted(launched - names)}"
    problems = []
    for k in kernels:
        calls = sorted(_calls(k), key=lambda c: (c.lineno, c.col_offset))
        waits = [c for c in calls if _named(c, "_await_predecessor")]
        releases = [c for c in calls if _named(c, "_release_dependents")]
        if len(waits) != 1 or not releases:
            problems.append(f"{k.name}: {len(waits)} waits, {len(releases)} releases")
            continue
        wait = waits[0].lineno
        early = [c.lineno for c in calls if c.lineno < wait and _touches_memory(c)]
        if early:
            problems.append(f"{k.name}: memory touched before its wait at lines {early}")
        if any(r.lineno < wait for r in releases):
            problems.append(f"{k.name}: releases its dependents before it waits")
    assert not problems, problems


def test_the_order_check_sees_a_load_before_the_wait():
    """The check above on a kernel that loads before waiting, through a helper too."""
    bad = ast.parse(
        "def k(X, PDL):\n"
        "    x = _splits_sum(X, 1, 0, 1, 0, 1)\n"
        "    _await_predecessor(PDL)\n"
        "    _release_dependents(PDL)\n"
    ).body[0]
    calls = sorted(_calls(bad), key=lambda c: c.lineno)
    assert _touches_memory(calls[0])
    assert not any(_touches_memory(c) for c in _calls(FUNCTIONS["_prefetch_l2"]))


def _sweep_launches(arch: int, **overrides) -> list:
    case = gpu_compile.Case("testing_tiny", 3, dtype="bf16", overrides=tuple(overrides.items()))
    records = gpu_compile.record_launches(case, sm_count=132, arch=arch)
    return [
        r for r in records if r.kernel is not None and r.phase.startswith(("forward", "reverse"))
    ]


def test_hopper_dry_runs_launch_every_step_kernel_as_a_dependent():
    records = _sweep_launches(90)
    assert records
    for r in records:
        assert r.meta.get("PDL") is True and r.meta.get("launch_pdl") is True, r.name
        if r.kernel is tk.linear_kernel:  # its first weight tiles prefetched into L2
            assert r.meta["PREFETCH_K"] >= r.meta["BLOCK_K"]


@pytest.mark.parametrize(
    "arch, overrides", [(80, {}), (90, {"dependent_launch": False})], ids=["sm_80", "option off"]
)
def test_no_dependent_launch_on_ampere_or_with_the_option_off(arch, overrides):
    records = _sweep_launches(arch, **overrides)
    assert records
    assert all(r.meta.get("PDL") is False and "launch_pdl" not in r.meta for r in records)


def test_the_interpreter_never_launches_dependents(monkeypatch):
    """CPU tensors run in the interpreter, whose launches have no grid dependency control,
    even where a test gives them the GPU's block sizes."""
    monkeypatch.setattr(geometry, "interpreting", lambda t: False)
    with execution(assumed_arch=90):
        assert geometry.dependent_launch(torch.zeros(1)) == {"PDL": False}
        assert geometry.dependent_launch(torch.zeros(1, device="meta"))["PDL"] is True


def test_dependent_launch_option_is_a_bool():
    assert EngineOptions().dependent_launch is True
    with pytest.raises(ConfigError, match="dependent_launch: expected true or false"):
        EngineOptions(dependent_launch="yes")


def test_a_dependent_launch_is_priced_with_the_shorter_gap():
    from gpn_scale.accounting.step_model import gpu_ceilings

    h200 = gpu_ceilings("h200")
    plain = Op("reverse step: row", "sequential backward", 10**6, 0, False)
    dependent = Op("reverse step: row", "sequential backward", 10**6, 0, False, dependent=True)
    saved = pricing.price(plain, h200, True).seconds - pricing.price(dependent, h200, True).seconds
    assert saved == pytest.approx(pricing.GRAPH_GAP_S - pricing.DEPENDENT_GAP_S)
    assert 0 < pricing.DEPENDENT_GAP_S < pricing.GRAPH_GAP_S
