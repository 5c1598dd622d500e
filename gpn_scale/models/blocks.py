"""Pieces the baseline families share: the SwiGLU MLP and the pending-token shift (their head
loss, a block of positions at a time, is models/linear_cross_entropy.py).

The pending token is how a family without a natural carry meets the interface's alignment
rule (protocol.py: logits[:, t] predicts tokens[:, t]). Its state holds the last input it has
not yet consumed, a learned start token at the beginning; a window's inputs are that token
followed by all but the window's last token, which becomes the next pending one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), no biases (LLaMA's MLP)."""

    def __init__(self, d_model: int, d_ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, d_ffn, bias=False)
        self.up = nn.Linear(d_model, d_ffn, bias=False)
        self.down = nn.Linear(d_ffn, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def shift_in(tokens: Tensor, pending: Tensor) -> tuple[Tensor, Tensor]:
    """(inputs, next pending): inputs[:, 0] = pending, inputs[:, t] = tokens[:, t - 1].

    `pending` is (B,) token ids; the start token is id `vocab_size` (one extra embedding row).
    """
    inputs = torch.cat([pending[:, None].to(tokens.dtype), tokens[:, :-1]], dim=1)
    return inputs, tokens[:, -1]


def start_tokens(batch_size: int, vocab_size: int, device: torch.device | str | None) -> Tensor:
    """The pending tokens of a fresh state: the start token (id `vocab_size`) in every row."""
    return torch.full((batch_size,), vocab_size, dtype=torch.long, device=device)
