"""A family-free language model with known logits: a bigram table over the byte vocabulary.

It implements the LanguageModel protocol the way a pending-token family does (the state is
the last token seen, the start id V before any), so scores can be computed by hand:
logits of token t = table[token t-1]. It counts the tokens it is fed, to check that a
context runs once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from gpn_scale.models.protocol import LMOutput

V = 257


class FakeState(NamedTuple):
    pending: Tensor  # (B,) the last token seen (V = none yet)


class BigramLM(nn.Module):
    def __init__(self, table: Tensor) -> None:
        super().__init__()
        assert table.shape == (V + 1, V)
        self.table = nn.Parameter(table.clone(), requires_grad=False)
        self.config: Any = None
        self.tokens_seen = 0

    def initial_state(self, batch_size: int, device: Any = None) -> FakeState:
        return FakeState(torch.full((batch_size,), V, dtype=torch.long, device=device))

    def forward(self, tokens, state=None, *, return_state=False, return_logits=False):
        B, T = tokens.shape
        self.tokens_seen += B * T
        state = state if state is not None else self.initial_state(B, tokens.device)
        prev = torch.cat([state.pending[:, None], tokens[:, :-1]], dim=1)
        logits = self.table[prev]
        loss = nn.functional.cross_entropy(logits.reshape(B * T, V), tokens.reshape(-1))
        return LMOutput(
            loss,
            FakeState(tokens[:, -1].clone()) if return_state else None,
            logits if return_logits else None,
        )

    def next_token_logits(self, state: FakeState) -> Tensor:
        return self.table[state.pending]

    def num_parameters(self) -> int:
        return self.table.numel()


def bigram(pairs: dict[tuple[str, str], float]) -> BigramLM:
    """A table of zeros with logit `v` for byte b after byte a, for each ((a, b), v)."""
    table = torch.zeros(V + 1, V, dtype=torch.float64)
    for (a, b), v in pairs.items():
        table[V if a == "" else ord(a), ord(b)] = v
    return BigramLM(table)
