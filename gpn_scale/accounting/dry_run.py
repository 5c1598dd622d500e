"""Dry runs of the CUDA path: the engine's training step on meta tensors, as one rank of a
tensor-parallel group (`accounting/gpu_model.py` prices its launches, `accounting/gpu_compile.py`
compiles them)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from gpn_scale.ops.gpn_step import chunk


class TpRank:
    """A step backend seeing the plans of one rank of a tp group of `tp` (no group: the
    dry run reduces nothing), so that it runs its tensor-parallel code path."""

    def __init__(self, backend, tp: int) -> None:
        self.backend, self.tp, self.name = backend, tp, backend.name
        self.row_alignment = backend.row_alignment
        self.matmul_only_adjoints = backend.matmul_only_adjoints

    def forward_chunk(self, plan, W, chunk):
        return self.backend.forward_chunk(dataclasses.replace(plan, tp_size=self.tp), W, chunk)

    def reverse_sweep(self, plan, Wt, sweep):
        return self.backend.reverse_sweep(dataclasses.replace(plan, tp_size=self.tp), Wt, sweep)


@contextlib.contextmanager
def as_tp_rank(tp: int) -> Iterator[None]:
    """Within the block the engine's step backends are those of one rank of a tp group (the
    model built at its local widths)."""
    if tp == 1:
        yield
        return
    real = chunk.select_backend
    chunk.select_backend = lambda choice, device, tp_size=1: TpRank(  # type: ignore[assignment]
        real(choice, device, tp), tp
    )
    try:
        yield
    finally:
        chunk.select_backend = real
