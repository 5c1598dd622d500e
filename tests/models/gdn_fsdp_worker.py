"""One rank of the Gated DeltaNet FSDP2 test (started by test_gated_deltanet.py, like torchrun:
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment).

    python gdn_fsdp_worker.py <out_dir>

Each rank trains its rows of the shared batch with FSDP2 per block (the family's fsdp_units,
then the root), carrying the recurrent state across steps; rank 0 writes the per-step mean
losses and the full final weights to <out_dir>/fsdp.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gdn_train import STEPS, make_batches, make_model, train_steps  # noqa: E402


def main(out: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    spec, model = make_model()
    units = spec.fsdp_units(model)
    assert len(units) == model.config.n_layers
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Really sharded: each rank holds its share of a block's first projection.
    q = model.layers[0].attn.q_proj.weight
    assert q.to_local().shape[0] == q.shape[0] // world

    batches = make_batches()
    rows = batches[0].shape[0] // world
    local = [b[rank * rows : (rank + 1) * rows] for b in batches]
    losses = train_steps(model, local)
    mean = []
    for loss in losses:
        t = torch.tensor([loss])
        dist.all_reduce(t)
        mean.append(t.item() / world)
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        assert len(mean) == STEPS
        torch.save({"losses": mean, "weights": full}, out / "fsdp.pt")
    check_bf16_keeps_the_carried_memory_float32(mesh, local)
    dist.barrier()
    dist.destroy_process_group()


def check_bf16_keeps_the_carried_memory_float32(mesh, batches: list[torch.Tensor]) -> None:
    """Under FSDP2 bf16 mixed precision the carried memory reaches each layer in float32
    (FSDP2 casts the floating tensors of a unit's arguments; the layer state must escape it)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    spec, model = make_model()
    model = model.float()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in spec.fsdp_units(model):
        fully_shard(unit, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    seen: list[torch.dtype] = []
    for block in model.layers:
        block.attn.register_forward_pre_hook(lambda mod, args: seen.append(args[1].memory.dtype))
    state = None
    for tokens in batches[:2]:
        out = model(tokens, state, return_state=True)
        out.loss.backward()
        state = out.state.detach()
    assert seen == [torch.float32] * (2 * len(model.layers)), seen
    assert all(s.memory.dtype == torch.float32 for s in state.layers)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
