"""Run under `torch.distributed.run --nproc_per_node=4` (gloo, CPU) by test_vocab_parallel.py:
the vocabulary-parallel loss, embedding and gathered logits against the one-process ops.

Every rank builds the same full inputs from one seed; the tp form gets this rank's rows of E.
tp = 4 is the whole world, tp = 2 its two groups {0, 1} and {2, 3} (one launch, both sizes).
Per case: the loss and every gradient (P, norm, W_dec, bias, this rank's rows of E) against
`chunked_decode_cross_entropy` on the full E in this process, and the shape of every tensor
the call (forward and backward) produced, recorded by a TorchDispatchMode. Rank 0 gathers
every rank's results and writes them as JSON to argv[1].
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gpn_scale.models.gpn.loss import chunked_decode_cross_entropy
from gpn_scale.models.gpn.vocab_parallel import embed, gather_vocab
from gpn_scale.testing.workers import end_worker

# Every size but V/tp is <= V/4 = 24, so a tensor with a dimension above V/tp can only be
# a vocabulary one: (rows x V) or (N x V) logits, or a full (V x e) gradient.
V, N, d, e = 96, 24, 16, 8


class Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.seen += [tuple(t.shape) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return dict(
        P=r(N, d),
        norm_w=1 + 0.3 * r(d),
        W_dec=0.4 * r(e, d),
        b_dec=0.2 * r(e),
        E=r(V, e),
        targets=torch.randint(0, V, (N,), generator=g),
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


def loss_case(group, tp: int, rows: int, dtype: torch.dtype, mm) -> dict:
    rank = dist.get_rank(group)
    x = inputs(dtype)
    Vl = V // tp
    mine = slice(rank * Vl, (rank + 1) * Vl)
    leaves = ["P", "norm_w", "W_dec", "b_dec", "E"]
    full = {k: (v.clone().requires_grad_(k in leaves)) for k, v in x.items()}
    shard = {k: (v.clone().requires_grad_(k in leaves)) for k, v in x.items()}
    shard["E"] = x["E"][mine].clone().requires_grad_()
    upstream = 0.7  # a non-unit dL/dloss reaches every gradient
    out = {}
    for name, args, kw in (("full", full, {}), ("tp", shard, {"tp_group": group})):
        rec = Shapes()
        with rec:
            loss = chunked_decode_cross_entropy(
                *(args[k] for k in ("P", "norm_w", "W_dec", "b_dec", "E", "targets")),
                rows=rows,
                mm_dtype=mm,
                scale=1.0 / N,
                **kw,
            )
            (loss * upstream).backward()
        out[name] = (loss.detach(), args, max(max(s) for s in rec.seen if s))
    (lf, af, big_full), (lt, at, big_tp) = out["full"], out["tp"]
    errors = {"loss": _rel(lf, lt)}
    for k in ("P", "norm_w", "W_dec", "b_dec"):
        errors[f"grad {k}"] = _rel(af[k].grad, at[k].grad)
    errors["grad E rows"] = _rel(af["E"].grad[mine], at["E"].grad)
    # The same loss on every rank of the group.
    gathered = [torch.zeros_like(lt) for _ in range(tp)]
    dist.all_gather(gathered, lt.contiguous(), group=group)
    errors["loss across ranks"] = max(float((t - lt).abs()) for t in gathered)
    return {"errors": errors, "largest_dim_full": big_full, "largest_dim_tp": big_tp, "Vl": Vl}


def embed_case(group, tp: int) -> dict:
    rank = dist.get_rank(group)
    Vl = V // tp
    x = inputs(torch.float64)
    E_full = x["E"].clone().requires_grad_()
    E_local = x["E"][rank * Vl : (rank + 1) * Vl].clone().requires_grad_()
    tokens = torch.randint(0, V, (3, 8), generator=torch.Generator().manual_seed(5))
    weight = torch.randn(3, 8, e, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    ref, got = F.embedding(tokens, E_full), embed(tokens, E_local, group)
    (ref * weight).sum().backward()
    (got * weight).sum().backward()
    h = torch.randn(4, e, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    h.requires_grad_()
    logits = gather_vocab(h @ E_local.detach().t(), group)
    (logits * torch.arange(V, dtype=torch.float64)).sum().backward()
    return {
        "lookup": float((ref - got).detach().abs().max()),  # exact: one rank contributes each row
        "grad E rows": _rel(E_full.grad[rank * Vl : (rank + 1) * Vl], E_local.grad),
        "gathered logits": _rel(h.detach() @ x["E"].t(), logits.detach()),
        # backward: this rank's slice only; the replicated h's gradient is this rank's share
        "gather grad": _rel(
            torch.arange(V, dtype=torch.float64)[rank * Vl : (rank + 1) * Vl]
            @ x["E"][rank * Vl : (rank + 1) * Vl],
            h.grad[0],
        ),
    }


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {4: dist.group.WORLD, 2: halves[dist.get_rank() // 2]}
    result = {}
    for tp, group in groups.items():
        for rows in (6, 5):  # divides N = 24, does not
            result[f"tp{tp} rows{rows} float64"] = loss_case(group, tp, rows, torch.float64, None)
        result[f"tp{tp} rows5 bf16 matmuls"] = loss_case(
            group, tp, 5, torch.float32, torch.bfloat16
        )
        result[f"tp{tp} embedding"] = embed_case(group, tp)
    everyone = [None] * world
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(everyone, fh)
    dist.destroy_process_group()
    end_worker()


if __name__ == "__main__":
    main()
