"""Run under `torch.distributed.run` (gloo, CPU) by test_tensor_parallel.py: the GPN engine
with its parameters sharded over a tp mesh against the same model in one process, float64.

Every rank builds both models from the same seed; the TP copy is sharded (parallel/tp.py).
With the CUDA backend (eager) the "launch accounting" entry is 0 when the dry accounting at
this tp (`gpu_model.account(..., tp=)`) counts the launches and all-reduces it really made.
Per case: the loss of two consecutive windows (the second starting from the first's carry,
gradients flowing through both), every parameter's gradient (gathered to full tensors),
the final carry (s, s_prev, and this rank's heads of the memory), and the gathered full
logits (`return_logits`, `next_token_logits`). Rank 0 writes the worst relative errors as
JSON to the path given. --backend (default auto) is the TP copy's step backend:
`reference`, `cuda` (the Triton kernels, on CPU tensors in Triton's interpreter) or
`cuda-graphs` (the same through the chunk graphs, their capture the eager stand-in);
--cases a comma-separated subset of CASES; --shape the windows' B,T; --float32-cases cases
also run in float32 (results keyed "<case> float32").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gpn_scale.accounting import gpu_model
from gpn_scale.models.gpn.parallelize import apply_tp, tp_plan
from gpn_scale.ops import launch
from gpn_scale.ops.execution import execution
from gpn_scale.ops.gpn_step import graphs
from gpn_scale.ops.gpn_step.registry import ENV_VAR, select_backend
from gpn_scale.ops.triton_interpreter import prepare_interpreter
from gpn_scale.testing.models import gpn_cases, perturbed_model, tiny_config
from gpn_scale.testing.workers import end_worker

# Widths a tp group of up to 4 splits: 4 heads, d_ffn 24, vocab_size 40 (the embedding / tied
# output is vocabulary-parallel: 10 rows per rank at tp = 4); loss_chunk_tokens 7 does not
# divide the 33 positions of a window.
SPLITS = dict(d_ffn=24, vocab_size=40, loss_chunk_tokens=7)
CASES = {
    **gpn_cases("1-layer", "2-layer", "tbptt-2-layer", n_heads=4, **SPLITS),
    **gpn_cases("gpn-no-memory", **SPLITS),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


def run_case(
    cfg, mesh, backend: str = "auto", B: int = 3, T: int = 11, dtype=torch.float64
) -> dict[str, float]:
    ref = perturbed_model(cfg, dtype)
    step_backend = "cuda" if backend.startswith("cuda") else backend
    tp = perturbed_model(cfg, dtype)
    tp.config = cfg.replace(step_backend=step_backend, cuda_graphs=backend == "cuda-graphs")
    apply_tp(tp, mesh, tp_plan(tp))
    gen = torch.Generator().manual_seed(3)
    w1, w2 = (torch.randint(0, cfg.vocab_size, (B, T), generator=gen) for _ in range(2))
    errors: dict[str, float] = {}
    outs = []
    for model in (ref, tp):
        graphed = model is tp and backend == "cuda-graphs"
        with (
            execution(graph_capture=graphs.eager_capture if graphed else None),
            launch.recording() if model is tp else contextlib.nullcontext() as launches,
        ):
            first = model(w1, return_state=True)
            second = model(w2, first.state, return_state=True)
            (first.loss + second.loss).backward()
        outs.append((first, second))
    if backend == "cuda":
        errors["launch accounting"] = _accounting_mismatch(cfg, mesh.size(), launches, B, 2 * T)
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


def _accounting_mismatch(cfg, tp: int, launches, B: int, steps: int) -> float:
    """0 when the launch accounting's dry run at tp (`gpu_model --tp`) counts what this
    rank really launched: the same kinds of launches and all-reduces, as many per step."""
    # Split-K sums follow the GEMMs split to fill the SMs, a choice of the block sizes (the
    # interpreter's tiles split where the GPU's do not): counted apart on both sides.
    split = gpu_model.SPLIT_SUM
    acc = gpu_model.account(cfg.replace(cuda_graphs=False), batch=B, seq_len=8, tp=tp)
    dry = {
        op.name
        for op in acc.ops
        if op.triton and op.phase in gpu_model.SEQUENTIAL and split not in op.name
    }
    real = {f"{x.phase}: {x.name}" for x in launches if split not in x.name}
    got = [
        sum(
            1
            for x in launches
            if x.phase == kind
            and split not in x.name
            and x.name.startswith(launch.COLLECTIVE) == collective
        )
        / steps
        for kind in ("forward step", "reverse step")
        for collective in (False, True)
    ]
    want = [
        f(phase)
        for phase in gpu_model.SEQUENTIAL
        for f in (
            lambda ph: acc.launches_per_step(ph) - acc.split_sums_per_step(ph),
            acc.collectives_per_step,
        )
    ]
    return float(dry != real or got != want)


def main() -> None:
    prepare_interpreter()  # where the test set TRITON_INTERPRET (the cuda backends)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    os.environ.pop(ENV_VAR, None)  # the backend is the one asked for here
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--shape", default="3,11")
    parser.add_argument("--float32-cases", default="", help="also run these in float32")
    args = parser.parse_args()
    B, T = (int(x) for x in args.shape.split(","))
    result = {
        name: run_case(tiny_config(**CASES[name]), mesh, args.backend, B, T)
        for name in args.cases.split(",")
    }
    for name in filter(None, args.float32_cases.split(",")):
        cfg = tiny_config(**CASES[name])
        result[f"{name} float32"] = run_case(cfg, mesh, args.backend, B, T, torch.float32)
    if args.backend.startswith("cuda"):  # which path ran: the chunk graphs' counters
        chunk_graphs = select_backend("cuda", torch.device("cpu")).graphs
        result["graphs"] = {"captures": chunk_graphs.captures, "replays": chunk_graphs.replays}
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()
    end_worker()


if __name__ == "__main__":
    main()
