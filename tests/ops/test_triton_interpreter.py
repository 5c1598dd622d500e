"""gpn_scale/ops/triton_interpreter.py: the interpreter's builtin walk, cached, binds the same
attributes as the walk it replaces, outside a launch and inside one (where a helper's call
finds them bound already), and the kernels that run through it give the same results; its
float32 -> bfloat16 casts round to nearest even as the GPU's do, bit for bit with torch's, in
every process that launches through `gpn_scale.ops.launch`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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

    from gpn_scale.ops.triton_interpreter import speed_up_patching

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
    from gpn_scale.ops.triton_interpreter import speed_up_patching

    assert speed_up_patching()
    x = torch.linspace(-1, 1, 37, dtype=torch.float64)
    y = torch.empty_like(x)
    _helper_kernel[(3,)](x, y, 37, BLOCK=16)
    want = torch.cat([torch.exp(c) * 2 + c.sum() for c in x.split(16)])
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)


@triton.jit
def _to_bf16_kernel(x_ptr, cast_ptr, stored_ptr, toward_zero_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(cast_ptr + offs, x.to(tl.bfloat16))
    tl.store(stored_ptr + offs, x)  # a bf16 pointer: the store casts
    tl.store(toward_zero_ptr + offs, x.to(tl.bfloat16, fp_downcast_rounding="rtz"))


def _hard_float32s() -> torch.Tensor:
    """Values whose bf16 rounding is easy to get wrong, and random ones: ties (to even, up and
    down), a carry into the exponent, the largest finite (rounds to inf), subnormals, signed
    zeros, inf and NaN."""
    bits = [
        0x3F808000,  # 1 + 2^-8: a tie, rounds down to the even 1.0
        0x3F818000,  # 1 + 3 * 2^-8: a tie, rounds up to the even 1 + 2^-6
        0x3F808001,  # just past a tie: up
        0x3F807FFF,  # just short of one: down (truncation gives the same)
        0x3FFFFFFF,  # 2 - 2^-23: carries into the exponent, 2.0
        0x7F7FFFFF,  # the largest finite float32: inf
        0x00008000,  # a subnormal tie
        0x0000C000,  # a subnormal above a tie
        0x80000000,  # -0.0
        0xBF818000,  # a negative tie
        0x7F800000,  # inf
        0x7FC00000,  # NaN
    ]
    hard = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    rand = torch.randn(128 - len(bits), generator=torch.Generator().manual_seed(0)) * 3
    return torch.cat([hard, rand])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_bf16_casts_round_to_nearest_even_as_the_gpu_and_rtz_still_truncates():
    from gpn_scale.ops.triton_interpreter import prepare_interpreter

    prepare_interpreter()
    x = _hard_float32s()
    cast, stored, toward_zero = (torch.empty(128, dtype=torch.bfloat16) for _ in range(3))
    _to_bf16_kernel[(1,)](x, cast, stored, toward_zero, BLOCK=128)
    want = x.to(torch.bfloat16)  # round to nearest even: the GPU's cvt.rn.bf16.f32
    finite = ~torch.isnan(x)
    assert torch.equal(_bits(cast)[finite], _bits(want)[finite])
    assert torch.equal(_bits(stored)[finite], _bits(want)[finite])
    assert torch.isnan(cast[~finite]).all() and torch.isnan(stored[~finite]).all()
    assert cast[4].item() == 2.0 and cast[5].item() == float("inf")
    # An explicit round toward zero is left to Triton's own conversion: truncation (which
    # that conversion gets wrong for subnormals, left out here).
    normal = finite & ((x.abs() >= torch.finfo(torch.float32).tiny) | (x == 0))
    truncated = (x.view(torch.int32) >> 16).to(torch.int16)
    assert torch.equal(_bits(toward_zero)[normal], truncated[normal])


KERNEL_SCRIPT = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch, triton, triton.language as tl
from gpn_scale.ops.launch import launch

@triton.jit
def cast_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))

x = torch.randn(256, generator=torch.Generator().manual_seed(1))
direct, launched = torch.empty(256, dtype=torch.bfloat16), torch.empty(256, dtype=torch.bfloat16)
cast_kernel[(1,)](x, direct, BLOCK=256)  # before any launch through the seam: Triton's own
launch(cast_kernel, (1,), "cast", "test", 0, 0, x, launched, BLOCK=256)
rne = x.to(torch.bfloat16)
print(int((direct != rne).sum()), int((launched != rne).sum()))
"""


def test_a_launch_through_the_seam_rounds_in_a_process_the_tests_did_not_prepare(tmp_path):
    script = tmp_path / "cast_kernel.py"  # a file: triton.jit reads its kernel's source
    script.write_text(textwrap.dedent(KERNEL_SCRIPT))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    direct_off, launched_off = map(int, proc.stdout.split()[-2:])
    assert direct_off > 50  # Triton's interpreter truncates: about half of random values differ
    assert launched_off == 0
