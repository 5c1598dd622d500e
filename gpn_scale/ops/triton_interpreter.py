"""Triton's interpreter (TRITON_INTERPRET=1), which runs the CUDA path's kernels on CPU tensors
in the tests and the device check's CPU smoke run, made cheaper and made to round as the GPU
does. `prepare_interpreter()` applies both; every launch through `gpn_scale.ops.launch` calls
it when interpreting, so the kernels round alike in every process that runs them.

**Its cost.** Before every kernel launch, and again at every call of a `@triton.jit` helper
inside a program instance, the interpreter rebinds triton.language's builtins to interpreted
ones: it walks `inspect.getmembers` of tl, tl.tensor, tl.math and
tl.core.tensor_descriptor_base and wraps each builtin it finds. The modules do not change, so
the walk finds the same builtins each time; in the step backend's tests it was ~30% of the
interpreter's time (cProfile, tests/ops/test_gpn_step.py's 1-layer float64 case: 39,924
walks, 12.0 s of 40.1 s). `speed_up_patching()` keeps what the walk found the first time and,
on every later call, wraps those of them that are not wrapped yet, as the walk does: the
bindings are the same, only the walk is gone.

**Its rounding.** A float32 value cast to bfloat16 (`x.to(tl.bfloat16)`, or stored through a
bf16 pointer) compiles to `cvt.rn.bf16.f32` on the GPU: round to nearest, ties to even. The
interpreter (triton 3.6 and 3.8) truncates instead, and its explicit round-to-nearest mode
neither breaks ties to even nor carries into the exponent. Truncation is biased: under bf16
autocast the interpreted CUDA path's gradients drifted from the GPU's numerics (with torch
2.11, the GPU image's, one gradient's error from float32 was 4.5x the PyTorch steps' instead
of the 1.3x it is when rounded). `round_bf16_casts_to_nearest_even()` converts those casts
with torch's own float32 -> bfloat16 conversion (round to nearest even, as the GPU); an
explicit round-toward-zero cast still truncates.

Each is applied only where the interpreter has the shape it was written against (triton 3.x's
`_patch_builtin(pkg, builder, scope)` and `_convert_float(input, input_dtype, output_dtype,
rounding_mode)`); anywhere else it leaves the interpreter as it is."""

from __future__ import annotations

import inspect
import os

_PATCHED_FLAG = "_gpn_scale_patched"  # on a function this module put in the interpreter
_prepared = False


def _interpreter_function(name: str, params: list[str]):
    """(the interpreter module, its function `name`) where TRITON_INTERPRET=1 and the function
    has the parameters this module was written against; (module, None) where it is replaced
    already; None where it is not to be replaced (no interpreter, or another shape)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    original = getattr(interpreter, name, None)
    if original is None:
        return None
    if getattr(original, _PATCHED_FLAG, False):
        return interpreter, None
    if list(inspect.signature(original).parameters) != params:
        return None
    return interpreter, original


def _install(interpreter, name: str, replacement, original) -> None:
    setattr(replacement, _PATCHED_FLAG, True)
    replacement.__wrapped__ = original
    setattr(interpreter, name, replacement)


def speed_up_patching() -> bool:
    """Cache the interpreter's builtin walk (see the module docstring). Returns whether it is
    in place: False without TRITON_INTERPRET, without triton, or with an interpreter whose
    patching differs from the one this was written against."""
    found = _interpreter_function("_patch_builtin", ["pkg", "builder", "scope"])
    if found is None:
        return False
    interpreter, original = found
    if original is None:
        return True
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if patch_attr is None:
        return False
    from triton.language import core

    builtins_of: dict[object, list[tuple[str, object]]] = {}  # modules and classes: by identity

    def patch_builtin(pkg, builder, scope) -> None:
        known = builtins_of.get(pkg)
        if known is None:
            # The first walk runs outside any launch (a launch patches before its helpers
            # run), so it sees the unwrapped builtins, as the interpreter's own walk does.
            known = [(n, m) for n, m in inspect.getmembers(pkg) if core.is_builtin(m)]
            builtins_of[pkg] = known
        for name, member in known:
            # What the walk would find: a builtin not yet wrapped (inside a launch, a
            # helper's call finds them wrapped already and leaves them).
            if getattr(pkg, name, None) is member:
                patch_attr(pkg, name, member, builder, scope)

    _install(interpreter, "_patch_builtin", patch_builtin, original)
    return True


def round_bf16_casts_to_nearest_even() -> bool:
    """Make the interpreter's float32 -> bfloat16 casts round as the GPU's (see the module
    docstring). Returns whether it is in place: False without TRITON_INTERPRET, without
    triton, or with an interpreter whose conversion differs from the one this was written
    against."""
    found = _interpreter_function(
        "_convert_float", ["input", "input_dtype", "output_dtype", "rounding_mode"]
    )
    if found is None:
        return False
    interpreter, original = found
    if original is None:
        return True
    rounding = getattr(getattr(interpreter, "_ir", None), "ROUNDING_MODE", None)
    if rounding is None:
        return False
    import numpy as np
    import torch
    import triton.language as tl

    toward_zero = rounding.RTZ

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        to_bf16 = input_dtype == tl.float32 and output_dtype == tl.bfloat16
        if to_bf16 and rounding_mode != toward_zero:
            values = torch.from_numpy(np.array(input, dtype=np.float32, copy=True))
            return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return original(input, input_dtype, output_dtype, rounding_mode)

    _install(interpreter, "_convert_float", convert_float, original)
    return True


def prepare_interpreter() -> None:
    """Both of the above, where TRITON_INTERPRET=1; once done, a flag's read (it runs before
    every interpreted launch)."""
    global _prepared
    if not _prepared:
        cached = speed_up_patching()
        rounded = round_bf16_casts_to_nearest_even()
        _prepared = cached and rounded
