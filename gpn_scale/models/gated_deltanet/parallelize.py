"""Gated DeltaNet tensor-parallel plan: heads split over the tp ranks (Megatron's split of a
block, as for Transformer++, with the GDN layer's per-head pieces sharded alike).

Per block: the token mixer's q, k, v, a (decay), b (beta) and output-gate projections are
column-parallel, so each rank holds H/tp heads; the short convolutions (depthwise: one
filter per channel), A_log and dt_bias are sharded along the same heads; the delta rule, its
memory (B, H/tp, dk, dv) and the per-head output norm run on local heads with no
communication; o_proj is row-parallel (one all-reduce). The SwiGLU MLP: gate/up column-,
down row-parallel. The output norm's weight (dv values, shared by every head) stays whole on
each rank, and its gradient, a sum over heads, is summed over the group. Norms of the
residual stream, the embedding and the head stay replicated plain parameters (on the dp
mesh under FSDP2). The layer computes H / tp heads (`tp_size`, set here), so the same
module runs sharded or whole.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def tp_plan(model: nn.Module) -> dict[str, Any]:
    """module path -> ParallelStyle for `torch.distributed.tensor.parallel.parallelize_module`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(len(model.layers)):  # type: ignore[arg-type]
        prefix = f"layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj"):
            plan[f"{prefix}.attn.{name}"] = ColwiseParallel()
        plan[f"{prefix}.attn.o_proj"] = RowwiseParallel()
        for name in ("mlp.gate", "mlp.up"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        plan[f"{prefix}.mlp.down"] = RowwiseParallel()
    return plan


def apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    """Shard the blocks over `tp_mesh` in place: the linear layers with torch's
    parallelize_module, the per-head parameters (convolution filters, A_log, dt_bias) as
    Shard(0) DTensors, the output norm's shared weight as a Replicate() DTensor."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, tp_plan(model))

    def place(module: nn.Module, leaf: str, placement: Any) -> None:
        param = getattr(module, leaf)
        dt = distribute_tensor(param.detach(), tp_mesh, [placement], src_data_rank=0)
        module.register_parameter(leaf, nn.Parameter(dt, requires_grad=param.requires_grad))

    for block in model.layers:  # type: ignore[union-attr]
        attn = block.attn
        for conv in (attn.q_conv, attn.k_conv, attn.v_conv):
            place(conv, "weight", Shard(0))
        place(attn, "A_log", Shard(0))
        place(attn, "dt_bias", Shard(0))
        place(attn.o_norm, "weight", Replicate())
        attn.tp_size = tp_mesh.size()


def check_tp(cfg: Any, tp: int, where: str = "parallel.tp") -> None:
    """One line naming the field when the model does not split over `tp` ranks (the same
    fields and message as Transformer++'s: heads and FFN width)."""
    from gpn_scale.models.transformer_pp.parallelize import check_tp as check_heads_and_ffn

    check_heads_and_ffn(cfg, tp, where)
