"""gpn_scale/testing/triton_interpreter.py: the interpreter's builtin walk, cached, binds the same
attributes as the walk it replaces, outside a launch and inside one (where a helper's call
finds them bound already), and the kernels that run through it give the same results."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter"
)


@triton.jit
def _scaled(x, s):
    return tl.exp(x) * s


@triton.jit
def _helper_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, _scaled(x, 2.0) + tl.sum(x, axis=0), mask=mask)


def _bound(patch_builtin, interpreter, pkgs) -> list[tuple[int, str]]:
    scope = interpreter._LangPatchScope()
    try:
        for pkg in pkgs:
            patch_builtin(pkg, interpreter.interpreter_builder, scope)
        return [(id(obj), name) for obj, name, _ in scope._changes]
    finally:
        scope.restore()


def test_the_cached_walk_binds_what_the_walk_binds():
    from triton.runtime import interpreter

    from gpn_scale.testing.triton_interpreter import speed_up_patching

    assert speed_up_patching()
    cached = interpreter._patch_builtin
    walk = cached.__wrapped__
    pkgs = [tl, tl.tensor, tl.math, tl.core.tensor_descriptor_base]
    outside = _bound(walk, interpreter, pkgs)
    assert len(outside) > 50  # tl's builtins (load, store, dot, ...) and tensor's operators
    assert _bound(cached, interpreter, pkgs) == outside

    # Inside a launch: everything is bound already, and neither binds anything again.
    launch = interpreter._LangPatchScope()
    try:
        for pkg in pkgs:
            walk(pkg, interpreter.interpreter_builder, launch)
        assert _bound(walk, interpreter, pkgs) == []
        assert _bound(cached, interpreter, pkgs) == []
    finally:
        launch.restore()
    assert _bound(cached, interpreter, pkgs) == outside  # restored: unbound again


def test_a_kernel_with_a_helper_runs_the_same_through_the_cached_walk():
    from gpn_scale.testing.triton_interpreter import speed_up_patching

    assert speed_up_patching()
    x = torch.linspace(-1, 1, 37, dtype=torch.float64)
    y = torch.empty_like(x)
    _helper_kernel[(3,)](x, y, 37, BLOCK=16)
    want = torch.cat([torch.exp(c) * 2 + c.sum() for c in x.split(16)])
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
