"""One rank of a multi-process checkpoint test (started by test_distributed.py, like torchrun:
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment).

    python dist_worker.py fsdp_save   <out_dir> <root> [<root> ...]
    python dist_worker.py deepspeed   <out_dir> <root>

Assertions fail the process (non-zero exit); the test prints the output.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_helpers import assert_same, make_mlp  # noqa: E402

from gpn_scale.checkpoint import CheckpointError, CheckpointManager  # noqa: E402


def _batches(n: int, rank: int, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return [torch.randn(4, 6, generator=g) for _ in range(n)]


def fsdp_save(out: Path, roots: list[str]) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = make_mlp(seed)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    model, opt = build(0)
    for x in _batches(3, rank):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    # Sanity: really sharded (each rank holds half of the first weight's rows).
    assert model[0].weight.to_local().shape[0] == 16 // world

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    ref_model, ref_optim = get_state_dict(model, opt, options=full)
    if rank == 0:
        torch.save({"model": ref_model, "optim": ref_optim}, out / "reference.pt")

    for root in roots:
        mgr = CheckpointManager(root, staging_dir=str(out / "stage"))
        mgr.preflight()
        msd, osd = get_state_dict(model, opt)
        uri = mgr.save(
            5,
            {"model": msd, "optim": osd},
            meta={"step": 5, "tokens": 640},
            rank_state={"rank": torch.tensor([rank])},
        )
        assert mgr.latest() == uri, (mgr.latest(), uri)

        # Same world size: a fresh FSDP2 model/optimizer gets back the same state and rank_state.
        model2, opt2 = build(123)
        msd2, osd2 = get_state_dict(model2, opt2)
        app = {"model": msd2, "optim": osd2}
        loaded = mgr.load(uri, app)
        set_state_dict(model2, opt2, model_state_dict=app["model"], optim_state_dict=app["optim"])
        got_model, got_optim = get_state_dict(model2, opt2, options=full)
        assert_same(got_model, ref_model, "model")
        assert_same(got_optim, ref_optim, "optim")
        assert loaded.world_size == world and loaded.step == 5
        assert loaded.rank_state is not None and int(loaded.rank_state["rank"]) == rank

    # Rank 1 fails to upload in the next save: every rank gets the same one-line error (nobody
    # hangs), and the step-5 checkpoint stays the latest.
    mgr = CheckpointManager(roots[0], staging_dir=str(out / "stage"))
    if rank == 1:

        def broken_put(local_path, key):  # type: ignore[no-untyped-def]
            raise CheckpointError(f"cannot write checkpoint file {key}: disk full")

        mgr.storage.put_file = broken_put  # type: ignore[method-assign]
    msd, osd = get_state_dict(model, opt)
    try:
        mgr.save(6, {"model": msd, "optim": osd}, meta={"step": 6})
    except CheckpointError as exc:
        msg = str(exc)
        assert (
            "\n" not in msg
            and "step_000000006 not saved" in msg
            and "on rank 1" in msg
            and "disk full" in msg
        ), msg
    else:
        raise AssertionError("save with a failing rank did not raise")
    assert mgr.latest() is not None and mgr.latest().endswith("step_000000005")
    assert not (Path(roots[0]) / "step_000000006" / "manifest.json").exists()
    dist.barrier()
    dist.destroy_process_group()


def deepspeed_run(out: Path, root: str) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    config = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True},
        },
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
    }

    def build(seed: int):  # type: ignore[no-untyped-def]
        model = make_mlp(seed)
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        return engine

    def train(engine, batches) -> list[float]:  # type: ignore[no-untyped-def]
        losses = []
        for x in batches:
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    def fp32_partitions(engine) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
        return [t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups]

    def adam_state(engine) -> list[dict]:  # type: ignore[no-untyped-def]
        inner = engine.optimizer.optimizer  # the torch AdamW over this rank's flat partitions
        return [
            {k: v.clone() for k, v in inner.state[p].items()}
            for g in inner.param_groups
            for p in g["params"]
        ]

    engine = build(0)
    train(engine, _batches(3, rank))
    mgr = CheckpointManager(root, staging_dir=str(out / "stage"))
    mgr.preflight()
    rank_state = {"rank": rank, "rng": torch.get_rng_state()}
    uri = mgr.save_deepspeed(3, engine, meta={"step": 3}, rank_state=rank_state)
    assert mgr.latest() == uri
    saved_partitions, saved_adam = fp32_partitions(engine), adam_state(engine)
    later = _batches(2, rank, seed=8)
    losses_a = train(engine, later)

    engine2 = build(42)
    assert not torch.equal(fp32_partitions(engine2)[0], saved_partitions[0])
    loaded = mgr.load_deepspeed(mgr.latest(), engine2)
    assert loaded.step == 3 and loaded.meta == {"step": 3} and loaded.kind == "deepspeed"
    assert_same(loaded.rank_state, rank_state)
    assert_same(fp32_partitions(engine2), saved_partitions, "fp32 partitions")
    assert_same(adam_state(engine2), saved_adam, "adam state")
    losses_b = train(engine2, later)
    assert losses_a == losses_b, (losses_a, losses_b)  # the resumed run continues identically
    for (n, p), (_, q) in zip(engine.module.named_parameters(), engine2.module.named_parameters()):
        assert torch.equal(p, q), n
    dist.barrier()
    if rank == 0:
        (out / f"deepspeed_ok_{root.replace('/', '_')[-40:]}").write_text("ok")


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out_dir, *roots = sys.argv[1:]
    if mode == "fsdp_save":
        fsdp_save(Path(out_dir), roots)
    elif mode == "deepspeed":
        for root in roots:
            deepspeed_run(Path(out_dir), root)
    else:
        raise SystemExit(f"unknown mode {mode}")
