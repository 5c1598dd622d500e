"""`python -m gpn_scale.accounting.gpu_model`: the launch accounting of a GPN training step
on CUDA and its predicted time (the model: accounting/step_model.py; the tables, the JSON and
the comparison with a committed device run: accounting/gpu_report.py).

    python -m gpn_scale.accounting.gpu_model gpn_m_130m --batch 64            # tables
    python -m gpn_scale.accounting.gpu_model gpn_m_130m --batch 64 --json     # one object
    python -m gpn_scale.accounting.gpu_model gpn_m_130m --batch 128 --engine bf16_memory_reads=true
    python -m gpn_scale.accounting.gpu_model gpn_m_130m --against docs/device-runs/2026-12-04-h200

The step model's names are importable from here as well (sweeps, tp_model and the tests
read them as gpu_model.*).
"""

from __future__ import annotations

import os
import sys

from gpn_scale.accounting.kernel_record import SEQUENTIAL, Op
from gpn_scale.accounting.step_model import (
    COLLECTIVE_S,
    GPUS,
    GRAPH_GAP_S,
    HOST_LAUNCH_S,
    LAUNCHER_S,
    SIDE_WORK,
    SPLIT_SUM,
    Accounting,
    Baseline,
    Prediction,
    account,
    account_baseline,
    baseline_for,
    gpu_ceilings,
    predict,
    predicted_mfu,
    pricing_basis,
    role,
)

__all__ = [
    "COLLECTIVE_S",
    "GPUS",
    "GRAPH_GAP_S",
    "HOST_LAUNCH_S",
    "LAUNCHER_S",
    "SEQUENTIAL",
    "SIDE_WORK",
    "SPLIT_SUM",
    "Accounting",
    "Baseline",
    "Op",
    "Prediction",
    "account",
    "account_baseline",
    "baseline_for",
    "gpu_ceilings",
    "main",
    "predict",
    "predicted_mfu",
    "pricing_basis",
    "role",
]


def main(argv: list[str] | None = None) -> int:
    from gpn_scale.accounting import gpu_report

    return gpu_report.main(argv)


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)  # --compiled compiles the kernels themselves
    sys.exit(main())
