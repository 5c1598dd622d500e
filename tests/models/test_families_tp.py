"""Tensor parallelism of the baseline families (each family's `apply_tp` plan): 2 gloo ranks
equal one process, float64: the loss, every gradient, a cached continuation and the next
token's logits from a carried state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from gpn_scale.models.registry import config_from_dict

pytestmark = pytest.mark.slow

CASES = {
    "transformer_pp": dict(
        family="transformer_pp", vocab_size=40, d_model=32, n_layers=2, n_heads=4, d_ffn=48
    ),
    "transformer_pp_tied": dict(
        family="transformer_pp",
        vocab_size=40,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ffn=48,
        tie_embeddings=True,
    ),
    "gated_deltanet": dict(
        family="gated_deltanet",
        vocab_size=40,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_key=8,
        d_value=8,
        d_ffn=48,
        chunk_size=4,
    ),
}
# A column-parallel weight of the first block: (rows per rank, in) when really sharded.
SHARDED = {
    "transformer_pp": ("layers.0.attn.q.weight", [16, 32]),
    "transformer_pp_tied": ("layers.0.attn.q.weight", [16, 32]),
    "gated_deltanet": ("layers.0.attn.q_proj.weight", [16, 32]),
}


def _run(model, tokens: torch.Tensor) -> dict:
    """loss, gradients (full tensors), and the continuation's logits of a cached state."""
    out = model(tokens)
    out.loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = g.tolist()
    with torch.no_grad():
        state = model(tokens[:, :5], return_state=True).state
        cont = model(tokens[:, 5:], state, return_logits=True).logits
        nxt = model.next_token_logits(model(tokens, return_state=True).state)
    return {
        "loss": float(out.loss.detach()),
        "grads": grads,
        "cont": cont.tolist(),
        "next": nxt.tolist(),
    }


def _case(name: str):
    spec, cfg = config_from_dict(CASES[name])
    torch.manual_seed(0)
    model = spec.build(cfg).double()
    tokens = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    return spec, model, tokens


def rank_main(rank: int, world: int, init_file: str, out_dir: str, name: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        spec, model, tokens = _case(name)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        spec.apply_tp(model, mesh)
        local = dict(model.named_parameters())[SHARDED[name][0]].to_local().shape
        result = {**_run(model, tokens), "local": list(local)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_tp_ranks_equal_one_process(tmp_path, name):
    spec, model, tokens = _case(name)
    ref = _run(model, tokens)
    mp.spawn(rank_main, args=(2, str(tmp_path / "init"), str(tmp_path), name), nprocs=2)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["local"] == SHARDED[name][1]  # really sharded: 2 of the 4 heads per rank
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-12)
        assert got["grads"].keys() == ref["grads"].keys()
        for key, g in ref["grads"].items():
            torch.testing.assert_close(
                torch.tensor(got["grads"][key]), torch.tensor(g), rtol=1e-10, atol=1e-12
            )
        for key in ("cont", "next"):
            torch.testing.assert_close(
                torch.tensor(got[key]), torch.tensor(ref[key]), rtol=1e-10, atol=1e-12
            )
