"""`compile.enable`: torch.compile applied to a built model's blocks, one compile per block.

torchtitan's apply_compile: the family names its blocks (`FamilySpec.compile_blocks`,
models/protocol.py) and whether each compiles as one graph (`compile_fullgraph`); this
module compiles each in place, after tensor parallelism (the graph sees the local shards and
the block's collectives) and before FSDP2 / ZeRO (their per-block units wrap the compiled
block, so the all-gathers and reduce-scatters stay outside the graph). Per block rather than
the whole model: the blocks are one module class, so one graph serves them all and the
compile time does not grow with depth; the embedding and the head (its chunked
cross-entropy, models/linear_cross_entropy.py) stay eager.

In place (`nn.Module.compile`, as torchtitan does now), not `torch.compile(block)`: the
latter returns a wrapper whose parameters are named `_orig_mod.…`, which would change every
state-dict key (checkpoints, exports, warm starts) and the module paths the tp plans and
weight-decay rules name; compiled or not, a run's checkpoints are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from gpn_scale.core.config import ConfigError


def apply_compile(
    blocks: Sequence[nn.Module],
    fullgraph: bool,
    log: Callable[[str], None] = print,
) -> None:
    """torch.compile each of `blocks` in place (its first call compiles; state dict unchanged)."""
    if not blocks:
        raise ConfigError(
            "compile.enable: this model declares no blocks to compile; set compile.enable=false"
        )
    for block in blocks:
        block.compile(fullgraph=fullgraph)
    log(
        f"compile: torch.compile on each of {len(blocks)} {type(blocks[0]).__name__} blocks "
        f"({'one graph each' if fullgraph else 'graph breaks allowed'}); the first step "
        "compiles them"
    )
