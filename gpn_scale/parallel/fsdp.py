"""FSDP2 (`torch.distributed.fsdp.fully_shard`) applied to a built model of any family.

Each of the family's `fsdp_units` (models/protocol.py; Transformer++: its blocks) is sharded
as its own unit, then the root takes what is left (embedding, final norm, head), as in
torchtitan. GPN declares no units, for this reason: the GPN forward reads every parameter
of its submodules directly inside one custom autograd engine; it never calls a submodule's
forward. FSDP2 unshards a unit's parameters
in that unit's forward pre-hook, so per-submodule units would never be unsharded here:
the whole model is ONE unit, sharded on the root (parameters are still sharded at rest, so
memory for weights + optimizer state is divided by the dp size; the full weights exist only
during forward/backward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def apply_fsdp2(
    model: nn.Module,
    dp_mesh,
    param_dtype: torch.dtype | None,
    reduce_dtype: str = "fp32",
    reshard_after_forward: bool = True,
    units: Sequence[nn.Module] = (),
) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # param_dtype None = keep fp32 compute (CPU default); on GPU the trainer passes bf16,
    # and the model keeps its recurrent state and memory in fp32 itself.
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=_DTYPES[reduce_dtype])
    for unit in units:
        fully_shard(unit, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return model
