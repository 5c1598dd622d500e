"""Run under `torch.distributed.run` (gloo, CPU) by test_tensor_parallel.py: the GPN engine
with its parameters sharded over a tp mesh against the same model in one process, float64.

Every rank builds both models from the same seed; the TP copy is sharded (parallel/tp.py).
Per case: the loss of two consecutive windows (the second starting from the first's carry,
gradients flowing through both), every parameter's gradient (gathered to full tensors),
the final carry (s, s_prev, and this rank's heads of the memory), and the gathered
full logits (`return_logits`, `next_token_logits`). Rank 0 writes the
worst relative errors as JSON to argv[1].
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gpn_scale.model.parallelize import tp_plan
from gpn_scale.parallel.tp import apply_tp
from gpn_scale.testing.models import perturbed_model, tiny_config

# vocab_size 40: the embedding / tied output is vocabulary-parallel (10 rows per rank at
# tp = 4); loss_chunk_tokens 7 does not divide the 33 positions of a window.
VOCAB = dict(vocab_size=40, loss_chunk_tokens=7)
CASES = {
    "1-layer": dict(n_heads=4, d_ffn=24, **VOCAB),
    "2-layer": dict(n_heads=4, d_ffn=24, n_layers=2, **VOCAB),
    "gpn-no-memory": dict(memory=False, d_ffn=24, **VOCAB),
    "tbptt-2-layer": dict(n_heads=4, d_ffn=24, n_layers=2, tbptt=5, chunk_size=3, **VOCAB),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


def run_case(cfg, mesh) -> dict[str, float]:
    ref = perturbed_model(cfg, torch.float64)
    tp = perturbed_model(cfg, torch.float64)
    apply_tp(tp, mesh, tp_plan(tp))
    gen = torch.Generator().manual_seed(3)
    w1, w2 = (torch.randint(0, cfg.vocab_size, (3, 11), generator=gen) for _ in range(2))
    errors: dict[str, float] = {}
    outs = []
    for model in (ref, tp):
        first = model(w1, return_state=True)
        second = model(w2, first.state, return_state=True)
        (first.loss + second.loss).backward()
        outs.append((first, second))
    (r1, r2), (t1, t2) = outs
    errors["loss"] = max(_rel(r1.loss, t1.loss), _rel(r2.loss, t2.loss))
    errors["state"] = max(_rel(r2.state.s, t2.state.s), _rel(r2.state.s_prev, t2.state.s_prev))
    if cfg.memory:
        per = cfg.n_heads // mesh.size()
        mine = slice(mesh.get_local_rank() * per, (mesh.get_local_rank() + 1) * per)
        errors["memory"] = _rel(r2.state.memory[:, mine], t2.state.memory)
    for (name, a), (_, b) in zip(ref.named_parameters(), tp.named_parameters()):
        errors[f"grad {name}"] = _rel(a.grad, b.grad.full_tensor())
    # The slow path: the full (B, T, V) logits and next_token_logits, gathered over the group.
    with torch.no_grad():
        want = ref(w2, r1.state, return_logits=True)
        got = tp(w2, t1.state, return_logits=True)
        assert got.logits.shape == want.logits.shape == (*w2.shape, cfg.vocab_size)
        errors["logits"] = _rel(want.logits, got.logits)
        errors["next_token_logits"] = _rel(
            ref.next_token_logits(r2.state), tp.next_token_logits(t2.state)
        )
    return errors


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    result = {name: run_case(tiny_config(**case), mesh) for name, case in CASES.items()}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
