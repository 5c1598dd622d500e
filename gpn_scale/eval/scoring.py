"""Scoring continuations with the carried state: the context runs once, every continuation of
it is scored from the state the context left (LAMBADA, lm-eval's loglikelihood).

Batching never pads a sequence the state will carry on from: contexts are batched only with
contexts of the same token length (no padding at all), and continuations, whose final state
is thrown away, are right-padded (by the alignment rule `logits[:, t]` depends only on
tokens before t, so padding after a continuation cannot change its scores, for any family).

The state is opaque (models/protocol.py); to score several continuations of one context
from one run of it, `select_state` indexes its batch dimension, which works for every state
built of tensors with the batch first, in tuples, lists, dicts, dataclasses or plain
classes (GPN's (s, s_prev, M), key/value caches, Gated DeltaNet's per-layer carries, pending
tokens; plain ints such as a cache length are kept). A state it cannot index falls back
to re-running the context with each continuation (`reuse=False` does that on purpose).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


class StateNotIndexable(TypeError):
    """The state has a part without the batch as its first dimension."""


def select_state(state: Any, index: Tensor, batch: int) -> Any:
    """The state of rows `index` (a long tensor) of a batch of `batch` sequences."""
    if isinstance(state, Tensor):
        if state.dim() == 0 or state.shape[0] != batch:
            raise StateNotIndexable(f"a state tensor of shape {tuple(state.shape)}")
        return state.index_select(0, index.to(state.device))
    if state is None or isinstance(state, (int, float, bool, str)):
        return state
    if isinstance(state, tuple) and hasattr(state, "_fields"):  # NamedTuple
        return type(state)(*(select_state(v, index, batch) for v in state))
    if isinstance(state, (tuple, list)):
        return type(state)(select_state(v, index, batch) for v in state)
    if isinstance(state, dict):
        return {k: select_state(v, index, batch) for k, v in state.items()}
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        changes = {
            f.name: select_state(getattr(state, f.name), index, batch)
            for f in dataclasses.fields(state)
        }
        return dataclasses.replace(state, **changes)
    slots = getattr(type(state), "__slots__", None)
    if slots is not None or hasattr(state, "__dict__"):  # a plain class of tensors
        names = [slots] if isinstance(slots, str) else list(slots or vars(state))
        if not names:
            raise StateNotIndexable(f"a state part of type {type(state).__name__}")
        new = copy.copy(state)
        for name in names:
            object.__setattr__(new, name, select_state(getattr(state, name), index, batch))
        return new
    raise StateNotIndexable(f"a state part of type {type(state).__name__}")


@dataclass
class ContinuationScore:
    """Per continuation token: log p(token | everything before it) and the argmax token."""

    logprobs: Tensor  # (n,) float64
    argmax: Tensor  # (n,) long
    tokens: Tensor  # (n,) long, the continuation itself

    @property
    def total(self) -> float:
        return float(self.logprobs.sum())

    @property
    def greedy(self) -> bool:
        """Every continuation token is the model's top-1 given its prefix (lm-eval's)."""
        return bool((self.argmax == self.tokens).all())


def _score_rows(logits: Tensor, conts: Sequence[Sequence[int]]) -> list[ContinuationScore]:
    """Scores of right-padded continuations from their logits (b, T, V)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    out = []
    for row, cont in enumerate(conts):
        n = len(cont)
        tok = torch.tensor(list(cont), dtype=torch.long, device=logp.device)
        lp = logp[row, :n].gather(-1, tok[:, None])[:, 0]
        out.append(ContinuationScore(lp.cpu(), logp[row, :n].argmax(-1).cpu(), tok.cpu()))
    return out


def _padded(seqs: Sequence[Sequence[int]], device: torch.device) -> Tensor:
    width = max(len(s) for s in seqs)
    out = torch.zeros(len(seqs), width, dtype=torch.long)  # pad id 0: never scored
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    return out.to(device)


def context_state(model: Any, contexts: Sequence[Sequence[int]], device: torch.device) -> Any:
    """The state after equal-length `contexts` (the initial state when they are empty)."""
    if len(contexts[0]) == 0:
        return model.initial_state(len(contexts), device)
    return model(_padded(contexts, device), return_state=True).state


@torch.no_grad()
def score_continuations(
    model: Any,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int = 16,
    device: torch.device | str = "cpu",
    reuse: bool = True,
) -> list[ContinuationScore]:
    """Score (context ids, continuation ids) pairs; continuations must be non-empty.

    Equal contexts run once; contexts of one length run in batches of `batch_size`; each
    context's continuations are scored from its state, `batch_size` continuations a forward.
    """
    device = torch.device(device)
    for _ctx, cont in requests:
        if len(cont) == 0:
            raise ValueError("an empty continuation has no tokens to score")
    by_context: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, (ctx, _) in enumerate(requests):
        by_context[tuple(ctx)].append(i)
    by_length: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for ctx_key in by_context:
        by_length[len(ctx_key)].append(ctx_key)
    results: list[ContinuationScore | None] = [None] * len(requests)
    for length in sorted(by_length):
        contexts = by_length[length]
        for start in range(0, len(contexts), batch_size):
            group = contexts[start : start + batch_size]
            jobs = [(row, i) for row, key in enumerate(group) for i in by_context[key]]
            state = context_state(model, group, device) if reuse else None
            for j in range(0, len(jobs), batch_size):
                chunk = jobs[j : j + batch_size]
                conts = [requests[i][1] for _, i in chunk]
                scores = None
                if state is not None:
                    rows = torch.tensor([row for row, _ in chunk], dtype=torch.long)
                    try:
                        sub = select_state(state, rows, len(group))
                    except StateNotIndexable:
                        state = None  # this family's state: re-run the contexts instead
                    else:
                        logits = model(_padded(conts, device), sub, return_logits=True).logits
                        scores = _score_rows(logits, conts)
                if scores is None:
                    full = [list(group[row]) + list(requests[i][1]) for row, i in chunk]
                    logits = model(_padded(full, device), return_logits=True).logits
                    scores = _score_rows(logits[:, length:], conts)
                for (_, i), score in zip(chunk, scores):
                    results[i] = score
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


@torch.no_grad()
def rolling_logprob(
    model: Any, tokens: Sequence[int], *, device: torch.device | str = "cpu", chunk: int = 2048
) -> float:
    """log p(tokens) of a whole text from the initial state, `chunk` tokens a forward, the
    state carried between chunks (exact: nothing is cut off, there is no window)."""
    device = torch.device(device)
    state = model.initial_state(1, device)
    total = 0.0
    for start in range(0, len(tokens), chunk):
        piece = torch.tensor([list(tokens[start : start + chunk])], dtype=torch.long, device=device)
        out = model(piece, state, return_state=True, return_logits=True)
        logp = torch.log_softmax(out.logits.double(), dim=-1)
        total += float(logp[0].gather(-1, piece[0][:, None]).sum())
        state = out.state
    return total
