"""The vocabulary-parallel embedding and the gathered logits (tensor parallelism, tp > 1).

Under `parallel.tp = N` the tied embedding / output matrix E (V, e) is Shard(0) over the tp
group (`gpn_scale.models.gpn.parallelize`): rank r holds rows [r V/N, (r+1) V/N). The lookup
takes the tokens in this rank's range (the others give zero rows) and sums the (B, T, e)
result over the group: forward all-reduce, backward identity (Megatron's
VocabParallelEmbedding + reduce_from_tensor_model_parallel_region). Exactly one rank
contributes each row, so the sum is the replicated lookup bit for bit. The loss over the
sharded logits is the tp form of `gpn_scale.models.gpn.loss`.

Hand-written rather than megatron-core's: its `VocabParallelEmbedding` owns its parameter
(ours is the model's DTensor shard) and needs megatron's global parallel_state, and
importing megatron.core.tensor_parallel for the one fitting piece (the 3-line reduce
autograd function, which does take a group) loads ~2200 modules (~2 s per rank) and warns
about Transformer Engine / Apex on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def vocab_start(E_local: Tensor, group: Any) -> int:
    """The first vocabulary row this rank holds (0 without a group)."""
    return 0 if group is None else dist.get_rank(group) * E_local.shape[0]


class _ReduceFromTP(torch.autograd.Function):
    """Forward: summed over the group; backward: identity (every rank's consumer of the
    sum is replicated, so each receives the whole gradient already)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        out = x.clone(memory_format=torch.contiguous_format)  # the input is left as it was
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def reduce_from_tp(x: Tensor, group: Any) -> Tensor:
    """x summed over the tp group with an identity backward (x itself without one)."""
    return x if group is None else _ReduceFromTP.apply(x, group)


def embed(tokens: Tensor, E_local: Tensor, group: Any) -> Tensor:
    """F.embedding(tokens, E) where E_local is this rank's vocabulary rows of E.

    One all-reduce of (B, T, e) per call under tp; the plain lookup without a group."""
    if group is None:
        return F.embedding(tokens, E_local)
    start = vocab_start(E_local, group)
    outside = (tokens < start) | (tokens >= start + E_local.shape[0])
    rows = F.embedding((tokens - start).masked_fill(outside, 0), E_local)
    return reduce_from_tp(rows.masked_fill(outside[..., None], 0.0), group)


class _GatherVocab(torch.autograd.Function):
    """Forward: the group's vocabulary shards of the last dim concatenated in rank order;
    backward: this rank's slice (Megatron's gather_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


def gather_vocab(logits_local: Tensor, group: Any) -> Tensor:
    """The full (..., V) logits from this rank's (..., V/tp) columns: the slow path
    (`return_logits`, `next_token_logits`: tests, evaluation, generation), which holds the
    whole vocabulary on every rank; training's loss never calls it."""
    return logits_local if group is None else _GatherVocab.apply(logits_local, group)
