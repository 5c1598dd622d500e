"""Transformer++ tensor-parallel plan (DTensor, Megatron's split of a block).

Per block: q, k, v and the SwiGLU's gate/up are column-parallel (each rank holds H/tp heads
and f/tp hidden units, so attention and the SiLU product run on local shards with no
communication), o and down are row-parallel (one all-reduce each, after the block's two
halves). Norms, the embedding and the head stay replicated: the head's V x d matmul is a
candidate for loss-parallel (vocabulary-sharded logits + torch's loss_parallel), which the
trainer does not use yet. `Attention` reads its head count from the projection's local
width, so the same module runs sharded or whole.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from gpn_scale.core.config import ConfigError


def tp_plan(model: nn.Module) -> dict[str, Any]:
    """module path -> ParallelStyle for `torch.distributed.tensor.parallel.parallelize_module`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(model.layers)):  # type: ignore[arg-type]
        prefix = f"layers.{i}"
        for name in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("attn.o", "mlp.down"):
            plan[f"{prefix}.{name}"] = RowwiseParallel()
    return plan


def apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    """Shard the blocks over `tp_mesh` in place (torch's parallelize_module)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, tp_plan(model))


def check_tp(cfg: Any, tp: int, where: str = "parallel.tp") -> None:
    """One line naming the field when the model does not split over `tp` ranks."""
    for name in ("n_heads", "d_ffn"):
        value = getattr(cfg, name)
        if tp > 1 and value % tp:
            raise ConfigError(
                f"model.{name}: {value} does not split over {where}={tp}; use a value "
                f"divisible by {tp} or another tp"
            )
