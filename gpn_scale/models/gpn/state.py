"""What GPN's forward carries and returns: a leaf module, so that the model (gpn.py) and the
sequence engine (engine.py, which the model calls) share these types without importing each
other."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class GPNState(NamedTuple):
    """The carry between tokens/windows: grounded state s, the one before it, and the memory."""

    s: Tensor  # (B, d)
    s_prev: Tensor  # (B, d)
    memory: Tensor | None  # (B, H, dk, dv), None for GPN

    def detach(self) -> GPNState:
        return GPNState(
            self.s.detach(),
            self.s_prev.detach(),
            None if self.memory is None else self.memory.detach(),
        )


class GPNOutput(NamedTuple):
    loss: Tensor  # mean cross-entropy over all B*T positions
    state: GPNState | None  # final carry (when asked for)
    logits: Tensor | None = None  # (B, T, V), only when asked for (tests/analysis)
