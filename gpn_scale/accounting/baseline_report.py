"""The Transformer++ in `gpu_model`'s reports: beside the GPN's prediction
(`prediction_lines`), and a device run's rows of it against the accounting's model of them
(`against_run`, `table`).

The ratio the device check reports (GPN+M / compiled Transformer++) has the Transformer++ in
its denominator, so the accounting's model of it (`baseline_model.py`) is held against a
run's measured rows as the GPN's steps are (`gpu_report.against`): per measured batch, eager
and compiled, the predicted and the measured step, priced with the run's ceilings. The model
priced is the one the device check trains beside the GPN (`step_model.baseline_for`), as this
tree runs it: where the Transformer++ step's code changed since the run's commit, the rows
measured another step, and the table says so (the 2026-12-04 run's loss formed the whole
(B*T x V) logits; the head loss has gone blockwise since).
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

from gpn_scale.accounting import device_runs
from gpn_scale.accounting.run_pricing import RunPricing
from gpn_scale.accounting.step_model import (
    GPUS,
    Accounting,
    Baseline,
    account_baseline,
    baseline_for,
    predict,
)
from gpn_scale.models.gpn import ConfigError, GPNConfig

# What a Transformer++ training step runs beyond torch: a change here since a run's commit
# makes that run's rows another step's.
TRANSFORMER_CODE = (
    "gpn_scale/models/transformer_pp",
    "gpn_scale/models/blocks.py",
    "gpn_scale/models/linear_cross_entropy.py",
    "gpn_scale/ops/cross_entropy.py",
    "gpn_scale/ops/cross_entropy_kernels.py",
)


def code_changed_since(commit: str) -> bool | None:
    """Whether the Transformer++ step's code differs between `commit` and this tree; None
    where git cannot say (no repository, an unknown commit)."""
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(
            ["git", "diff", "--quiet", commit, "--", *TRANSFORMER_CODE],
            cwd=root,
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {0: False, 1: True}.get(done.returncode)


@functools.cache
def _baseline(cfg: Any, batch: int, seq_len: int) -> Baseline:
    return account_baseline(cfg, batch, seq_len)  # a few seconds each: asked again per run


def against_run(p: RunPricing) -> dict[str, Any]:
    """The run's rows of the Transformer++ it trained beside its GPN, eager and compiled,
    against the accounting's prediction of each at the run's ceilings."""
    try:
        tcfg = baseline_for(p.cfg)
    except ConfigError as exc:  # a GPN too small to match (the tests' tiny ones)
        return {"model": None, "rows": [], "why": str(exc), "code_changed": None}
    rows = []
    for compiled in (False, True):
        name = tcfg.name + (device_runs.COMPILED if compiled else "")
        entry = p.blob.get("summary", {}).get(name)
        measured = entry.get("rows", []) if isinstance(entry, dict) else []
        for row in sorted(measured, key=lambda r: r["batch"]):
            if not row.get("step_s") or not p.wants(row["batch"]):
                continue
            predicted = _baseline(tcfg, row["batch"], p.seq_len).seconds(p.ceilings, compiled)
            rows.append(
                {
                    "model": name,
                    "batch": row["batch"],
                    "predicted_s": predicted,
                    "measured_s": row["step_s"],
                    "predicted_over_measured": predicted / row["step_s"],
                }
            )
    commit = p.meta.get("commit")
    return {
        "model": tcfg.name,
        "rows": rows,
        "commit": commit,
        "code_changed": code_changed_since(commit) if commit and rows else None,
    }


def table(result: dict[str, Any]) -> list[str]:
    """The comparison as markdown lines (`gpu_report.against_table`)."""
    if not result.get("rows"):
        what = result.get("model") or "the Transformer++ it trains"
        return ["", f"The run measured no rows of {what} at these batches."]
    lines = [
        "",
        f"{result['model']} (float32 parameters, bf16 autocast; accounting/baseline_model.py):",
        "",
        "| model | batch | predicted s/step | measured s/step | predicted / measured |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['batch']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
        f"{r['predicted_over_measured']:.2f} |"
        for r in result["rows"]
    ]
    changed = result.get("code_changed")
    if changed:
        lines += [
            "",
            f"Its step's code changed since the run ({str(result['commit'])[:7]}): the "
            "prediction is this tree's step, the measurement the run's.",
        ]
    elif changed is None:
        lines += ["", "Whether its code changed since the run, git could not say."]
    return lines


def prediction_lines(
    acc: Accounting, cfg: GPNConfig, gpus: list[str], baseline: Baseline | None
) -> list[str]:
    """The Transformer++ beside the GPN: its predicted tokens/s, compiled and eager."""
    if baseline is None:
        return []
    lines = [
        "",
        f"Beside what users would otherwise train: {baseline.config} (float32 parameters "
        "under bf16 autocast, flash attention, as the device check trains it), the same "
        "batch and T (accounting/baseline_model.py); compiled (compile.enable, the honest "
        "anchor) and eager:",
        "",
        "| GPU | GPN+M tokens/s (best path) | Transformer++ compiled tokens/s (MFU) | "
        "eager tokens/s (MFU) | GPN+M / compiled Transformer++ |",
        "|---|---|---|---|---|",
    ]
    for key in gpus:
        best = max(predict(acc, key, graphs=g, cfg=cfg).tokens_per_s for g in (True, False))
        comp, eager = baseline.tokens_per_s(key, True), baseline.tokens_per_s(key, False)
        lines.append(
            f"| {GPUS[key].name} | {best:,.0f} | {comp:,.0f} ({baseline.mfu(key, True):.1%}) "
            f"| {eager:,.0f} ({baseline.mfu(key, False):.1%}) | {best / comp:.2f} |"
        )
    return lines
