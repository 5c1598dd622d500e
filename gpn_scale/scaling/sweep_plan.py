"""What `gpn-scale sweep plan` prints of an expanded sweep (one row per run, then totals and
assumptions, then one row per family), and the trainer's own check of every run's config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpn_scale.core.config import ConfigError
from gpn_scale.models.registry import get_family
from gpn_scale.scaling.sweep_spec import Sweep, SweepError


def short(x: float) -> str:
    """A count in K/M/B/T with 3 significant digits (4.95M)."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def _mfu_text(hw: Mapping[str, Any]) -> str:
    if hw["mfu"] != "predicted":
        return f"{float(hw['mfu']):.0%} MFU"
    per_size = ", ".join(f"{size} {m:.1%}" for size, m in hw.get("predicted_mfu", {}).items())
    basis = f"; {hw['priced_with']}" if hw.get("priced_with") else ""
    return (
        f"the MFU predicted by gpn_scale.accounting.gpu_model at {hw['sequences_per_gpu']} "
        f"sequences per GPU (a size with a parallel.tp override: accounting/tp_model.py's "
        f"speed-up; {per_size}; give a measured hardware.mfu to override){basis}"
    )


def format_plan(sweep: Sweep) -> str:
    """The human-readable plan: one row per run, then totals and assumptions."""
    hw = sweep.hardware
    rows = [
        (
            "run",
            "family",
            "params",
            "tokens",
            "tok/param",
            "steps",
            "batch",
            "lr",
            "warmup",
            "FLOPs",
            "GPU-h",
        )
    ]
    for r in sweep.runs:
        rows.append(
            (
                r.name,
                r.family,
                short(r.params),
                short(r.tokens),
                f"{r.tokens_per_param:.3g}",
                str(r.total_steps),
                str(r.global_batch_size),
                f"{r.lr:.3g}",
                str(r.warmup_steps),
                f"{r.flops:.3g}",
                f"{r.gpu_hours:.3g}",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [
        f"sweep {sweep.name} ({sweep.path}): {len(sweep.runs)} runs = "
        f"{len({(r.size, r.tokens) for r in sweep.runs})} size/budget cells x "
        f"{len(sweep.seeds)} seeds {sweep.seeds}"
    ]
    if sweep.description:
        lines.append(sweep.description.strip())
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(
                cell.ljust(w) if c < 2 else cell.rjust(w)
                for c, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    r0 = sweep.runs[0]
    run_dirs = (
        r0.run_dir.rsplit("/", 1)[0] + "/<run>" if r0.run_dir else "runs/<run> (trainer default)"
    )
    lines += [
        f"total: {sweep.total_flops:.3g} FLOPs, {sweep.total_gpu_hours:,.4g} GPU-hours "
        f"(at {_mfu_text(hw)} of {float(hw['peak_tflops']):g} TFLOP/s per "
        f"{hw['gpu']}; FLOPs = 3 x forward per token)",
        f"data {r0.data_remote} (seq_len {r0.seq_len}); checkpoints "
        f"{r0.checkpoint_root.rsplit('/', 1)[0]}/<run>; run dirs "
        f"{run_dirs}"
        f"; W&B {r0.wandb_project}/{r0.wandb_group} ({r0.wandb_job_type})",
    ]
    lines += ["", *format_family_rows(sweep)]
    lines += [f"NOTE: {n}" for n in sweep.notes]
    return "\n".join(lines)


def format_family_rows(sweep: Sweep) -> list[str]:
    """One row per family label: its registry family, sizes, runs, parameter range, FLOPs and
    GPU-hours (what a families sweep spends on each curve)."""
    rows = [("family", "registry", "sizes", "runs", "params", "FLOPs", "GPU-h")]
    for fam in dict.fromkeys(r.family for r in sweep.runs):
        runs = [r for r in sweep.runs if r.family == fam]
        lo, hi = min(r.params for r in runs), max(r.params for r in runs)
        rows.append(
            (
                fam,
                ",".join(dict.fromkeys(r.registry_family for r in runs)),
                str(len({r.size for r in runs})),
                str(len(runs)),
                short(lo) if lo == hi else f"{short(lo)}-{short(hi)}",
                f"{sum(r.flops for r in runs):.3g}",
                f"{sum(r.gpu_hours for r in runs):.4g}",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    out = []
    for i, row in enumerate(rows):
        out.append(
            "  ".join(
                cell.ljust(w) if c < 2 else cell.rjust(w)
                for c, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def validate_with_trainer(sweep: Sweep) -> None:
    """Load every run's training config (base config + overrides) through the trainer's own
    schema, so a bad key or value fails at plan time, naming the run; and `compile.enable`
    against the run's family (GPN refuses it: a mixed sweep sets it on the baselines'
    entries, `overrides: [compile.enable=true]`)."""
    from gpn_scale.run.config import load_train_config
    from gpn_scale.run.model import check_compile

    for run in sweep.runs:
        try:
            cfg = load_train_config(run.base_config, run.train_overrides())
            check_compile(cfg, get_family(run.registry_family))
        except ConfigError as err:
            raise SweepError(f"run '{run.name}': the trainer rejects its config: {err}") from None
