"""The step's Triton GEMMs against cuBLAS at the same shapes, from one device run: which
projections `engine.cublas_gemms` should name (issue 34: "compare with cuBLAS at the same
shapes and use whichever is faster per shape, behind the same seam").

Per projection (ops/gpn_step/options.PROJECTIONS) and batch, a training step's seconds of
- **Triton**: the ledger's measured launches of the projection's GEMMs and their split-K sums
  (`s_per_step`, in sequence; a dY W^T's sum inside the row kernel that reads it is not
  separable and stays out, in Triton's favour);
- **cuBLAS**: the ceilings' measured product at that shape (`gemms`, alone, L2 cold) times the
  GEMM's launches a step, plus what the route adds beside the product (the scale and epilogue
  kernel, a cast of a float32 A, a row RMS's sums), predicted from this tree's launches
  with the run's ceilings (`extras`: the caller prices them).

A projection is compared where the ceilings timed cuBLAS at exactly the ledger's shape (equal
FLOPs a launch at M = the batch): the ceilings time the 130M's shapes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from gpn_scale.accounting import device_runs
from gpn_scale.accounting.run_pricing import RunPricing
from gpn_scale.accounting.step_model import account, predict

# Each projection's Triton GEMM launches, by role with the layer index taken out
# (`base_role`), and the split-K sums that finish them.
GEMM_ROLES: dict[str, tuple[str, ...]] = {
    "input": ("input GEMM",),
    "input_dx": ("input dy W^T", "predict-gate dy W^T"),
    "down": ("down GEMM", "down GEMM read", "down GEMM FFN"),
    "down_dx": ("down dy W^T",),
    "fuse_gate": ("fuse-gate GEMM",),
    "fuse_gate_dx": ("fuse-gate dy W^T",),
}
SPLIT_SUM = " (split-K sum)"
CUBLAS_PRODUCT = " (cuBLAS)"  # ops/gpn_step/gemm._cublas_product's record


def base_role(role: str) -> str:
    """A launch role without its layer index: 'down GEMM 1 (split-K sum)' -> 'down GEMM
    (split-K sum)'."""
    return re.sub(r" \d+(?= \(|$)", "", role)


def projection_of(role: str) -> str | None:
    """The projection whose Triton GEMM (or its split-K sum) `role` is, else None."""
    base = base_role(role).removesuffix(SPLIT_SUM)
    for projection, roles in GEMM_ROLES.items():
        if base in roles:
            return projection
    return None


def extra_projection(role: str) -> str | None:
    """The projection whose cuBLAS route added `role` beside its product (its epilogue, a
    cast of A, a row RMS's sums), else None."""
    base = base_role(role)
    if projection_of(role) is not None:
        return None  # a Triton GEMM (tp's 'down GEMM read' starts as 'down GEMM' does)
    for projection, roles in GEMM_ROLES.items():
        for gemm in roles:
            if base.startswith(gemm + " ") and not base.endswith(CUBLAS_PRODUCT):
                rest = base[len(gemm) :]
                if not rest.startswith(SPLIT_SUM):
                    return projection
    return None


def compare(
    ledger: list[dict[str, Any]],
    gemms: list[dict[str, Any]],
    steps_per_chunk: int,
    seq_len: int,
    extras: Mapping[int, Mapping[str, float]],
) -> list[dict[str, Any]]:
    """One row per (projection, batch) the ledger and the ceilings both have at the same
    shape: Triton's measured seconds a training step, cuBLAS's measured product times the
    launches, the route's predicted extras (`extras[batch][projection]`), and which is
    faster. `ledger`: one config's ledger rows; `gemms`: the run's ceilings.gemms."""
    chunks = seq_len / steps_per_chunk
    out = []
    for batch in sorted({r["batch"] for r in ledger}):
        rows = [r for r in ledger if r["batch"] == batch]
        for projection in GEMM_ROLES:
            own = [r for r in rows if projection_of(r["role"]) == projection]
            products = [r for r in own if not r["role"].endswith(SPLIT_SUM)]
            timed = [
                g
                for g in gemms
                if g.get("role") == projection
                and g.get("shape", [None])[0] == batch
                and isinstance(g.get("seconds"), (int, float))
            ]
            if not products or not timed:
                continue
            m, k, n = timed[0]["shape"]
            if any(r.get("flops") != 2 * m * k * n for r in products):
                continue  # another shape than the one cuBLAS was timed at
            launches = sum(r["launches_per_chunk"] for r in products) * chunks
            triton = sum(r["s_per_step"] for r in own)
            product = timed[0]["seconds"] * launches
            extra = float(extras.get(batch, {}).get(projection, 0.0))
            out.append(
                {
                    "projection": projection,
                    "batch": batch,
                    "shape": [m, k, n],
                    "triton_s": triton,
                    "cublas_product_s": product,
                    "cublas_extra_s": extra,
                    "cublas_s": product + extra,
                    "faster": "cuBLAS" if product + extra < triton else "Triton",
                }
            )
    return out


def setting(rows: list[dict[str, Any]]) -> str:
    """The `engine.cublas_gemms` value the comparison gives: the projections cuBLAS's route
    was faster for at every batch compared ('none' where it was for none)."""
    names = [
        p
        for p in GEMM_ROLES
        if any(r["projection"] == p for r in rows)
        and all(r["faster"] == "cuBLAS" for r in rows if r["projection"] == p)
    ]
    return ",".join(names) or "none"


def table(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the comparison and the setting it gives."""
    if not rows:
        return [
            "",
            "Step GEMMs against cuBLAS: the run has no ledger and cuBLAS timing at a common "
            "shape (the device check's ledger and ceilings.gemms).",
        ]
    lines = [
        "",
        "Step GEMMs against cuBLAS at the same shapes (s a training step; Triton and cuBLAS's "
        "product measured, its route's extra launches predicted):",
        "",
        "| projection | batch | M x K x N | Triton | cuBLAS product | + route | cuBLAS | faster |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['projection']} | {r['batch']} | {' x '.join(map(str, r['shape']))} | "
        f"{r['triton_s']:.4f} | {r['cublas_product_s']:.4f} | {r['cublas_extra_s']:.4f} | "
        f"{r['cublas_s']:.4f} | {r['faster']} |"
        for r in rows
    ]
    lines += ["", f"Whichever is faster at every batch: engine.cublas_gemms={setting(rows)}"]
    return lines


def against_run(p: RunPricing) -> list[dict[str, Any]]:
    """The run's Triton step GEMMs against cuBLAS at their shapes (`compare`):
    at each batch its ledger and its ceilings' cuBLAS rows share, the launches the cuBLAS
    route adds beside the product priced from this tree's launches of `engine.cublas_gemms
    =all` (the run's compiled facts, its ceilings)."""
    ledger = device_runs.ledger_rows(p.blob, p.config)
    gemms = [g for g in (p.blob.get("ceilings") or {}).get("gemms") or [] if isinstance(g, dict)]
    timed = {g["shape"][0] for g in gemms if isinstance(g.get("shape"), list) and g["shape"]}
    common = sorted(b for b in {r["batch"] for r in ledger} & timed if p.wants(b))
    via = p.cfg.replace(cublas_gemms="all")
    extras: dict[int, dict[str, float]] = {}
    for b in common:
        facts = device_runs.kernel_facts(p.run, p.config, b) or None
        acc = account(via, b, p.seq_len, p.config, facts=facts)
        priced = predict(acc, p.ceilings, p.graphs, via, placement=p.placement)
        added: dict[str, float] = {}
        for r, seconds in priced.per_role_seconds.items():
            projection = extra_projection(r)
            if projection is not None:
                added[projection] = added.get(projection, 0.0) + seconds
        extras[b] = added
    return compare(
        [r for r in ledger if r["batch"] in common],
        gemms,
        p.cfg.engine.chunk_size,
        p.seq_len,
        extras,
    )
