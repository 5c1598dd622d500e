"""Triton's interpreter (TRITON_INTERPRET=1), which runs the CUDA path's kernels on CPU tensors
in the tests, without its largest fixed cost.

Before every kernel launch, and again at every call of a `@triton.jit` helper inside a
program instance, the interpreter rebinds triton.language's builtins to interpreted ones: it
walks `inspect.getmembers` of tl, tl.tensor, tl.math and tl.core.tensor_descriptor_base and
wraps each builtin it finds. The modules do not change, so the walk finds the same builtins
each time; in the step backend's tests it was ~30% of the interpreter's time (cProfile,
tests/ops/test_gpn_step.py's 1-layer float64 case: 39,924 walks, 12.0 s of 40.1 s).

`speed_up_patching()` keeps what the walk found the first time and, on every later call, wraps
those of them that are not wrapped yet, as the walk does: the bindings are the same, only the
walk is gone. It is applied only where the interpreter has the shape this was written against
(triton 3.x's `_patch_builtin(pkg, builder, scope)`); anywhere else it leaves the interpreter as
it is."""

from __future__ import annotations

import inspect
import os

_PATCHED_FLAG = "_gpn_scale_cached_walk"


def speed_up_patching() -> bool:
    """Cache the interpreter's builtin walk (see the module docstring). Returns whether it is
    in place: False without TRITON_INTERPRET, without triton, or with an interpreter whose
    patching differs from the one this was written against."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.language import core
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if original is None or patch_attr is None:
        return False
    if getattr(original, _PATCHED_FLAG, False):
        return True
    if list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]:
        return False

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

    setattr(patch_builtin, _PATCHED_FLAG, True)
    patch_builtin.__wrapped__ = original  # type: ignore[attr-defined]
    interpreter._patch_builtin = patch_builtin
    return True
