"""GPN's tensor-parallel plan: which parameter shards along which axis (declarative).

Megatron's and torchtitan's head-sharded recurrent layers are the pattern: the memory heads
(write k, v, beta, decay; each layer's read q and gate; A_log, dt_bias; the read's output
norm weight) and the FFN hidden units are split across the tp ranks, column-parallel on the
way in (nn.Linear (out, in): Shard(0); W_1 in block layout (2, f, d): Shard(1), so each rank
gets the same columns of both halves a and b) and row-parallel on the way out (W_o, W_2:
Shard(1) of (d, in)). The tied embedding / output matrix E (V, e) is vocabulary-parallel
(Megatron's VocabParallelEmbedding): Shard(0), each rank holds V/tp rows
(`gpn_scale.model.vocab_parallel`, the tp form of `gpn_scale.model.loss`). Everything else
(the state path: fuse, gates, norms of the state, the decoder W_dec) is replicated.
`gpn_scale.parallel.tp` applies the plan; the engine finds the tp group on the DTensor
parameters and sums at the step's fixed points (`gpn_scale.ops.gpn_step.collectives`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import Placement

from gpn_scale.model.config import ConfigError, GPNConfig

_COLUMN = ("weight", "bias")  # Shard(0) of an nn.Linear (out, in) and of its bias


def tp_plan(model: nn.Module) -> dict[str, Placement]:
    """Parameter name -> placement on the tp mesh (absent names: Replicate())."""
    plan: dict[str, Placement] = {"embedding.weight": Shard(0)}  # (V, e): vocab rows
    if getattr(model, "write", None) is not None:
        for lin in ("key", "value", "beta", "decay"):
            for leaf in _COLUMN:
                plan[f"write.{lin}.{leaf}"] = Shard(0)
        plan["write.A_log"] = Shard(0)
        plan["write.dt_bias"] = Shard(0)
    for i, layer in enumerate(model.layers):  # type: ignore[arg-type]
        p = f"layers.{i}."
        plan[p + "ffn.w1.weight"] = Shard(1)  # (2, f, d): the f axis of both halves
        plan[p + "ffn.w2.weight"] = Shard(1)  # (d, f)
        if layer.read is not None:
            for lin in ("query", "gate"):
                for leaf in _COLUMN:
                    plan[f"{p}read.{lin}.{leaf}"] = Shard(0)
            plan[p + "read.out_norm_weight"] = Shard(0)  # (H*dv): its norm sums over ranks
            plan[p + "read.out.weight"] = Shard(1)  # (d, H*dv)
    names = {n for n, _ in model.named_parameters()}
    return {n: pl for n, pl in plan.items() if n in names}


def check_tp(cfg: GPNConfig, tp: int, where: str = "parallel.tp") -> None:
    """One line naming the field when the model does not split over `tp` ranks."""
    if tp == 1:
        return
    if cfg.memory and cfg.n_heads % tp:
        raise ConfigError(
            f"model.n_heads: {cfg.n_heads} heads do not split over {where}={tp}; "
            f"use a head count divisible by {tp} or another tp"
        )
    if cfg.d_ffn % tp:
        raise ConfigError(
            f"model.d_ffn: {cfg.d_ffn} does not split over {where}={tp}; "
            f"use a width divisible by {tp} or another tp"
        )
    if cfg.vocab_size % tp:
        pad = -(-cfg.vocab_size // tp) * tp
        raise ConfigError(
            f"model.vocab_size: {cfg.vocab_size} does not split over {where}={tp}; pad it to "
            f"a multiple of {tp} (e.g. model_overrides.vocab_size={pad}: a model vocabulary "
            "larger than the tokenizer's is supported) or use another tp"
        )
