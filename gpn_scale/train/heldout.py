"""Held-out loss and perplexity over fixed windows.

"Fixed" means the same windows at every evaluation of a run: a fresh validation loader is
built each time (never the training iterator) and its first `batches` batches are used.
Every position of every window counts (the model's loss already covers all B x T positions,
position 0 included), and the mean is token-weighted across ranks, so the figure does not
depend on the number of ranks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import torch


@torch.no_grad()
def heldout_loss(
    forward: Callable[[torch.Tensor], torch.Tensor],
    batches: Iterable[torch.Tensor],
    max_batches: int,
    device: torch.device,
    autocast=contextlib.nullcontext,
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, float]:
    """`forward(tokens) -> mean loss`; returns eval/loss, eval/ppl, eval/tokens.

    All ranks must call this together with the same `max_batches` (sharded models run
    collectives in their forward).
    """
    total = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    for i, tokens in enumerate(batches):
        if i >= max_batches:
            break
        tokens = tokens.to(device, non_blocking=True)
        with autocast():
            loss = forward(tokens)
        n = tokens.numel()
        total += float(loss.detach().float().item()) * n
        count += n
    pair = torch.stack([total, count])
    if all_reduce_sum is not None:
        pair = all_reduce_sum(pair)
    seen = float(pair[1])
    if seen == 0:
        raise RuntimeError("held-out evaluation saw no tokens (is the validation split empty?)")
    mean = float(pair[0]) / seen
    return {"eval/loss": mean, "eval/ppl": math.exp(min(mean, 700.0)), "eval/tokens": int(seen)}
