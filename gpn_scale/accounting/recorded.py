"""A training step's launches as the accounting counted them, kept with a device run
(`ops.json.gz`), so that a later accounting prices exactly the kernels that ran there even
after the code changed: each launch with its bytes, FLOPs and what its price depends on
(`kernel_costs.KernelCost`: occupancy, round trips and instructions per program, GEMM tile
geometry), identical launches stored once with their count.

`accounting/run_kernels.py` writes it from a tree whose kernel sources equal the measured
commit's; `gpu_model --against` reads it back.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Any

from gpn_scale.accounting.kernel_costs import KernelCost
from gpn_scale.accounting.kernel_record import Op
from gpn_scale.accounting.step_model import Accounting

OPS = "ops.json.gz"
_TUPLES = ("grid", "trips", "issued")


def _op_row(op: Op) -> dict[str, Any]:
    row = {k: v for k, v in dataclasses.asdict(op).items() if k != "cost"}
    row["cost"] = dataclasses.asdict(op.cost) if op.cost is not None else None
    return row


def _op(row: dict[str, Any]) -> Op:
    raw: dict[str, Any] | None = row.get("cost")
    cost = None
    if raw is not None:
        fields: dict[str, Any] = {k: tuple(v) if k in _TUPLES else v for k, v in raw.items()}
        cost = KernelCost(**fields)
    return Op(**{**{k: v for k, v in row.items() if k not in ("cost", "count")}, "cost": cost})


def accounting_json(acc: Accounting) -> dict[str, Any]:
    """`acc` as JSON: its shape and, per probe length, its distinct launches with counts."""
    probes = {}
    for T, ops in acc.probes.items():
        seen: dict[str, dict[str, Any]] = {}
        order: list[str] = []
        for op in ops:
            row = _op_row(op)
            key = json.dumps(row, sort_keys=True)
            if key in seen:
                seen[key]["count"] += 1
            else:
                seen[key] = {**row, "count": 1}
                order.append(key)
        probes[str(T)] = [seen[k] for k in order]
    fields = ("config", "batch", "seq_len", "chunk", "n_layers", "loop_weight_bytes",
              "m0_bytes", "loop_params", "tp", "compiled")  # fmt: skip
    return {**{f: getattr(acc, f) for f in fields}, "probes": probes}


def accounting_from_json(blob: dict[str, Any]) -> Accounting:
    probes = {}
    for T, rows in blob["probes"].items():
        ops: list[Op] = []
        for row in rows:
            op = _op(row)
            ops += [op] * int(row.get("count", 1))
        probes[int(T)] = ops
    fields = {k: v for k, v in blob.items() if k != "probes"}
    return Accounting(**fields, probes=probes)


def write(run: Path, accountings: list[Accounting]) -> None:
    """Every accounting, keyed by config and batch, into run/ops.json.gz."""
    blob = {f"{a.config} B={a.batch}": accounting_json(a) for a in accountings}
    with gzip.open(run / OPS, "wt") as f:
        json.dump(blob, f)


def read(run: Path, config: str, batch: int, seq_len: int) -> Accounting | None:
    """The recorded step of `config` at `batch` (extrapolated to `seq_len`), or None."""
    path = run / OPS
    if not path.is_file():
        return None
    with gzip.open(path, "rt") as f:
        blob = json.load(f).get(f"{config} B={batch}")
    if blob is None:
        return None
    acc = accounting_from_json(blob)
    acc.seq_len = seq_len
    return acc
