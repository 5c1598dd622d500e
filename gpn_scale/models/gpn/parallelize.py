"""GPN's tensor-parallel plan: which parameter shards along which axis (declarative).

Megatron's and torchtitan's head-sharded recurrent layers are the pattern: the memory heads
(write k, v, beta, decay; each layer's read q and gate; A_log, dt_bias; the read's output
norm weight) and the FFN hidden units are split across the tp ranks, column-parallel on the
way in (nn.Linear (out, in): Shard(0); W_1 in block layout (2, f, d): Shard(1), so each rank
gets the same columns of both halves a and b) and row-parallel on the way out (W_o, W_2:
Shard(1) of (d, in)). The tied embedding / output matrix E (V, e) is vocabulary-parallel
(Megatron's VocabParallelEmbedding): Shard(0), each rank holds V/tp rows
(`gpn_scale.models.gpn.vocab_parallel`, the tp form of `gpn_scale.models.gpn.loss`). Everything else
(the state path: fuse, gates, norms of the state, the decoder W_dec) is replicated.
`apply_tp` places the parameters as the plan says (DTensors on the tp mesh; everything not
named is Replicate(), so that FSDP2, DCP and the gradient norm see one mesh). This is
torchtitan's `parallelize_module` applied to parameters only: the forward reads the
parameters inside one autograd function and never runs a submodule's forward, so module
hooks (ColwiseParallel/RowwiseParallel) would never fire; the collectives sit inside the
engine instead, which finds the tp group on the DTensor parameters and sums at the step's
fixed points (`gpn_scale.ops.gpn_step.collectives`). The full model is built (and
initialised) whole on every rank from the same seed, then each rank keeps its shard: the same
seed gives the same logical model at any tp.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from gpn_scale.models.gpn.config import ConfigError, GPNConfig

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


def apply_tp(model: nn.Module, tp_mesh: Any, plan: Mapping[str, Placement] | None = None) -> None:
    """Replace every parameter of `model` by a DTensor on `tp_mesh` placed as `plan` (default:
    `tp_plan(model)`) says."""
    plan = tp_plan(model) if plan is None else plan
    unknown = sorted(set(plan) - {n for n, _ in model.named_parameters()})
    if unknown:
        raise ValueError(f"tp plan names {unknown[0]!r}, which the model does not have")
    prefixes = {id(m): name for name, m in model.named_modules()}

    def partition(_name: str, module: nn.Module, mesh: Any) -> None:
        base = prefixes[id(module)]
        for leaf, param in list(module.named_parameters(recurse=False)):
            full = f"{base}.{leaf}" if base else leaf
            placement = plan.get(full, Replicate())
            # src_data_rank=0: every rank takes its shard of rank 0's tensor (all ranks built
            # the same one from the seed; this makes it so even if they had not).
            dt = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=0)
            module.register_parameter(leaf, nn.Parameter(dt, requires_grad=param.requires_grad))

    distribute_module(model, tp_mesh, partition)


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
