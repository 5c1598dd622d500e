"""Decoding with the carried state: the prompt runs once, then one step per new token
(`next_token_logits(state)` for its distribution, `forward(token, state)` to carry it in);
the context is never recomputed. `gpn-scale generate` and lm-eval's generate_until use this.

Prompts of different lengths are never padded into one recurrent state: prompts are batched
with prompts of the same token length, and decoded in lockstep from there. Each prompt draws
from its own generator seeded `seed + its index`, so a sampled continuation depends on the
seed and the prompt, not on which other prompts shared its batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gpn_scale.core.config import ConfigError
from gpn_scale.eval.scoring import StateNotIndexable, context_state, select_state


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy (argmax); top_k 0 = off; top_p 1.0 = off."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: frozenset[int] = field(default_factory=frozenset)
    stop_strings: tuple[str, ...] = ()
    # Ids >= this are never chosen: a padded vocabulary (tp needs it) has logits for ids the
    # tokenizer does not have, which decode to nothing. None: every id of the model.
    vocab_limit: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ConfigError(f"--max-new-tokens {self.max_new_tokens!r}: expected an integer")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {self.max_new_tokens}: must be >= 1")
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k}: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p {self.top_p}: must be in (0, 1] (1 = off)")
        if any(s == "" for s in self.stop_strings):
            raise ConfigError("--stop: an empty stop string would stop at once; drop it")


@dataclass
class Generation:
    tokens: list[int]  # the new tokens (a stop token included; cut at a stop string)
    text: str  # their text, cut before the first stop string
    stopped: str  # "token", "string", "length" or "interrupted" (Ctrl-C)


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during `generate`: `generations` holds every prompt's text so far (stopped
    "interrupted" where it was cut, empty for prompts not yet started)."""

    def __init__(self, generations: list[Generation]) -> None:
        super().__init__("interrupted")
        self.generations = generations


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """(B, V) logits with the tokens outside top-k / the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the first over p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def _choose(logits: Tensor, sampling: Sampling, gens: list[torch.Generator]) -> Tensor:
    logits = logits.double()
    if sampling.vocab_limit is not None and sampling.vocab_limit < logits.shape[-1]:
        logits[:, sampling.vocab_limit :] = float("-inf")
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(
        filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p), -1
    ).cpu()
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(gens)])


def _cut(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


@torch.no_grad()
def generate(
    model: Any,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    *,
    decode: Callable[[list[int]], str] | None = None,
    batch_size: int = 16,
    device: torch.device | str = "cpu",
) -> list[Generation]:
    """Continue each prompt (token ids); stop at a stop token, a stop string (needs `decode`)
    or after max_new_tokens. Finished rows leave the batch when the state can be indexed."""
    device = torch.device(device)
    if sampling.stop_strings and decode is None:
        raise ValueError("stop strings need a decode function")
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_length[len(p)].append(i)
    out: list[Generation | None] = [None] * len(prompts)
    try:
        for length in sorted(by_length):
            members = by_length[length]
            for start in range(0, len(members), batch_size):
                idx = members[start : start + batch_size]
                group: list[Generation] = []
                try:
                    group = _decode_group(
                        model, [prompts[i] for i in idx], idx, sampling, decode, device
                    )
                except GenerationInterrupted as stop:
                    group = stop.generations
                    raise
                finally:
                    for i, gen in zip(idx, group):
                        out[i] = gen
    except KeyboardInterrupt:  # in a group's decoding, or before it (its prompt's forward)
        raise GenerationInterrupted(
            [g if g is not None else Generation([], "", "interrupted") for g in out]
        ) from None
    return [g for g in out if g is not None]


def _decode_group(
    model: Any,
    prompts: list[Sequence[int]],
    index: list[int],
    sampling: Sampling,
    decode: Callable[[list[int]], str] | None,
    device: torch.device,
) -> list[Generation]:
    n = len(prompts)
    state = context_state(model, prompts, device)
    gens = [torch.Generator().manual_seed(sampling.seed + i) for i in index]
    new: list[list[int]] = [[] for _ in range(n)]
    result: list[Generation | None] = [None] * n
    rows = list(range(n))  # batch position -> prompt of this group
    try:
        _decode_steps(model, state, sampling, decode, device, gens, new, result, rows)
    except KeyboardInterrupt:  # keep the text so far of every row of the group
        for row in range(n):
            if result[row] is None:
                text = decode(new[row]) if decode is not None else ""
                result[row] = Generation(
                    list(new[row]), _cut(text, sampling.stop_strings)[0], "interrupted"
                )
        raise GenerationInterrupted([r for r in result if r is not None]) from None
    return [r for r in result if r is not None]


def _decode_steps(
    model: Any,
    state: Any,
    sampling: Sampling,
    decode: Callable[[list[int]], str] | None,
    device: torch.device,
    gens: list[torch.Generator],
    new: list[list[int]],
    result: list[Generation | None],
    rows: list[int],
) -> None:
    """The decoding loop of one group: fills `new` and `result` in place (so an interrupt
    leaves them holding everything decoded so far)."""
    indexable = True
    for step in range(sampling.max_new_tokens):
        tok = _choose(model.next_token_logits(state), sampling, [gens[r] for r in rows])
        for pos, row in enumerate(rows):
            if result[row] is not None:  # finished; still in the batch (state not indexable)
                continue
            t = int(tok[pos])
            new[row].append(t)
            if t in sampling.stop_tokens:
                text = decode(new[row][:-1]) if decode is not None else ""
                result[row] = Generation(list(new[row]), text, "token")
                continue
            text = decode(new[row]) if decode is not None else ""
            text, hit = _cut(text, sampling.stop_strings)
            if hit:  # checked every step, so the stop string ends at this token
                result[row] = Generation(list(new[row]), text, "string")
            elif step == sampling.max_new_tokens - 1:
                result[row] = Generation(list(new[row]), text, "length")
        keep = [p for p, row in enumerate(rows) if result[row] is None]
        if not keep:
            break
        if indexable and len(keep) < len(rows):  # finished rows leave the batch
            try:
                state = select_state(state, torch.tensor(keep, dtype=torch.long), len(rows))
            except StateNotIndexable:
                indexable = False
            else:
                tok, rows = tok[keep], [rows[p] for p in keep]
        state = model(tok.to(device)[:, None], state, return_state=True).state
