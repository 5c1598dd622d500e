"""Each recorded launch specialised exactly as Triton's JIT would specialise it on the GPU
(its own binder: dtypes, 16-byte alignment of every pointer, ints equal to 1 as constexprs,
divisibility by 16), and the distinct compilations (`Variant`) the launches make on a
target (accounting/gpu_compile.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from gpn_scale.accounting.gpu_compile_cases import Target

_BASE = 0x7F00_0000_0000  # an allocation start: the caching allocator aligns blocks to 512 B


class _FakePointer:
    """What Triton's binder reads of a tensor argument: its dtype and address (whose
    alignment comes from the view's storage offset)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype = t.dtype
        self._address = _BASE + int(t.storage_offset()) * t.element_size()

    def data_ptr(self) -> int:
        return self._address


@dataclass
class Variant:
    """One distinct compilation of a kernel: what the JIT would compile once and reuse."""

    kernel: str  # the @triton.jit function's name
    module: str
    key: str  # hash of everything the compilation depends on
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    num_warps: int
    names: set[str] = field(default_factory=set)  # the launches' names
    phases: set[str] = field(default_factory=set)
    grids: set[tuple[int, ...]] = field(default_factory=set)
    launches: int = 0

    def programs(self) -> int:
        return max(_prod(g) for g in self.grids)

    def min_programs(self) -> int:
        return min(_prod(g) for g in self.grids)


def _prod(grid: Iterable[int]) -> int:
    n = 1
    for g in grid:
        n *= g
    return n


def _triton():
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    return triton, knobs, GPUTarget, make_backend, create_function_from_signature


def specialise(
    launches: Iterable, target: Target, keys: list[str | None] | None = None
) -> list[Variant]:
    """The distinct compilations the launches make on `target`, as Triton's JIT makes them;
    `keys`, when given, receives each launch's variant key (None: not a Triton launch)."""
    triton, knobs, GPUTarget, make_backend, create_binder = _triton()
    backend = make_backend(GPUTarget("cuda", target.arch, 32))
    binders: dict[int, Any] = {}
    variants: dict[str, Variant] = {}
    seen: dict[tuple, str] = {}  # what the binder reads of a launch -> its variant's key
    for rec in launches:
        kernel = rec.kernel
        if kernel is None:  # an ATen copy or a collective, recorded for the accounting
            if keys is not None:
                keys.append(None)
            continue
        # Triton's binder (~1 ms a launch) only reads dtypes, pointer alignment and, of ints,
        # whether they are 1, divisible by 16 and 32-bit: launches alike in those are one
        # variant, specialised once.
        probe = (id(kernel), *map(_arg_key, rec.args), *sorted(rec.meta.items()))
        key = seen.get(probe)
        if key is not None:
            v = variants[key]
            v.names.add(rec.name)
            v.phases.add(rec.phase)
            v.grids.add(tuple(rec.grid))
            v.launches += 1
            if keys is not None:
                keys.append(key)
            continue
        binder = binders.get(id(kernel))
        if binder is None:
            binder = binders[id(kernel)] = create_binder(kernel.signature, kernel.params, backend)
        args = [_FakePointer(a) if isinstance(a, torch.Tensor) else a for a in rec.args]
        kwargs = dict(rec.meta, debug=False)
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, spec, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound, spec, options
        )
        opts = {k: _plain(v) for k, v in options.__dict__.items()}
        consts = {k: _plain(v) for k, v in constexprs.items()}
        key = hashlib.sha256(
            repr(
                (
                    kernel.fn.__name__,
                    kernel.cache_key,
                    sorted(signature.items()),
                    sorted(consts.items(), key=repr),
                    sorted(attrs.items(), key=repr),
                    sorted(opts.items()),
                    target.arch,
                )
            ).encode()
        ).hexdigest()[:24]
        found = variants.get(key)
        if found is None:
            found = variants[key] = Variant(
                kernel.fn.__name__,
                kernel.fn.__module__,
                key,
                dict(signature),
                consts,
                dict(attrs),
                opts,
                options.num_warps,
            )
        found.names.add(rec.name)
        found.phases.add(rec.phase)
        found.grids.add(tuple(rec.grid))
        found.launches += 1
        seen[probe] = key
        if keys is not None:
            keys.append(key)
    return list(variants.values())


def _arg_key(a: Any) -> tuple:
    if isinstance(a, torch.Tensor):
        return ("t", a.dtype, (a.storage_offset() * a.element_size()) % 16 == 0)
    if isinstance(a, bool) or not isinstance(a, int):
        return ("v", type(a).__name__, a if isinstance(a, (bool, str)) or a is None else None)
    return ("i", a == 1, a % 16 == 0, -(2**31) <= a < 2**31)


def _plain(value: Any) -> Any:
    """Constexpr values and options as plain (picklable, printable) Python values."""
    if hasattr(value, "value") and type(value).__name__ == "constexpr":
        return value.value
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value
