"""Write a fit's outputs: fit.json (parameters with CIs, the gaps, the paper's 130M figures
beside the sweep's), report.md, and PNG plots."""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpn_scale.scaling.collect import Collection
from gpn_scale.scaling.fit import HUBER_DELTA, Cell, FitResult, aggregate
from gpn_scale.scaling.gaps import MEASURES, Comparison, format_point, format_value
from gpn_scale.scaling.paper import SOURCE, compare_with_paper, paper_lines


def _g(x: float | None, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}g}"


def build_json(
    fits: Sequence[FitResult],
    cells: Sequence[Cell],
    notes: Sequence[str],
    collection: Collection,
    settings: dict[str, Any],
    comparison: Comparison | None = None,
    paper: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "generated": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "protocol": {
            "objective": "sum of Huber(delta) over log L_pred - log L_obs (log L_pred by "
            "logsumexp of the log-terms), L-BFGS-B from a grid of initialisations",
            "huber_delta": HUBER_DELTA,
            "bootstrap": "seeds resampled with replacement within each (family, N, D) cell; "
            "percentile intervals",
            **settings,
        },
        "sources": collection.sources,
        "fits": [f.to_dict() for f in fits],
        "gaps": comparison.to_dict() if comparison is not None else None,
        "paper_130m": None if paper is None else {"source": SOURCE, "families": list(paper)},
        "cells": [
            {
                "family": c.family,
                "N": c.N,
                "D": c.D,
                "C": c.C,
                "loss_mean": c.mean,
                "loss_std": None if c.n < 2 else c.std,
                "n": c.n,
                "runs": list(c.runs),
            }
            for c in cells
        ],
        "missing_runs": [
            {"run": r.name, "location": r.location, "why": r.detail} for r in collection.missing
        ],
        "notes": list(notes),
    }


def build_markdown(
    fits: Sequence[FitResult],
    cells: Sequence[Cell],
    notes: Sequence[str],
    collection: Collection,
    settings: dict[str, Any],
    plots: Sequence[Path],
    comparison: Comparison | None = None,
    paper: Sequence[dict[str, Any]] | None = None,
) -> str:
    lvl = fits[0].ci_level if fits else 0.95
    lines = ["# Scaling-law fits", ""]
    lines += _protocol_lines(cells, collection, settings, lvl)
    for law in ("L(N)", "L(C)", "L(N,D)"):
        lf = [f for f in fits if f.form.key == law]
        if lf:
            lines += _law_lines(law, lf)
    if comparison is not None:
        lines += gap_lines(comparison)
    if paper is not None:
        lines += paper_lines(paper, float(settings.get("ci_level", lvl)))
    lines += _data_lines(cells)
    if notes or collection.missing:
        lines += ["## Notes", ""]
        lines += [f"- {n}" for n in notes]
        lines += [f"- missing: {r.name} ({r.location}): {r.detail}" for r in collection.missing]
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    return "\n".join(lines)


def _protocol_lines(
    cells: Sequence[Cell], collection: Collection, settings: dict[str, Any], lvl: float
) -> list[str]:
    """The report's opening: where the runs came from, and the fitting protocol."""
    return [
        f"Sources: {', '.join(collection.sources)}. {len(collection.usable)} runs with a "
        f"final held-out loss in {len(cells)} (family, N, D) cells"
        + (
            f"; {len(collection.missing)} runs missing (listed below)."
            if collection.missing
            else "."
        ),
        "",
        "Protocol: log-space parameters, log L_pred = logsumexp of the log-terms, "
        f"Huber (δ = {HUBER_DELTA:g}) on log-loss residuals, L-BFGS-B from a grid of "
        "initialisations (best kept"
        + (
            f"; only the {settings['max_starts']} with the lowest initial loss: --max-starts"
            if settings.get("max_starts")
            else ""
        )
        + "); seed bootstrap within cells, "
        f"{settings.get('resamples')} resamples (seed {settings.get('seed')}), "
        f"{lvl:.0%} percentile intervals.",
        "",
    ]


def _law_lines(law: str, lf: Sequence[FitResult]) -> list[str]:
    """One law's section: its formula, a row per family (parameters with their intervals,
    RMS log-residual) and the families' notes."""
    lines = [f"## {lf[0].form.formula()}", ""]
    names = list(lf[0].params)
    lines.append("| family | points | " + " | ".join(names) + " | RMS log-residual |")
    lines.append("|---" * (len(names) + 3) + "|")
    for f in lf:
        ci = f.ci
        vals = [
            _g(v) if f.interpolates else f"{_g(v)} [{_g(ci[k][0])}, {_g(ci[k][1])}]"
            for k, v in f.params.items()
        ]
        rms = math.sqrt(float((f.residuals() ** 2).mean()))
        points = f"{f.n_points} (interpolates)" if f.interpolates else f"{f.n_points}"
        lines.append(f"| {f.family} | {points} | " + " | ".join(vals) + f" | {rms:.2g} |")
    lines.append("")
    if law == "L(N,D)":
        lines += [
            "a_opt = β/(α+β) and b_opt = α/(α+β): compute-optimal N ∝ C^a_opt, D ∝ C^b_opt.",
            "",
        ]
    for f in lf:
        for n in f.notes:
            lines.append(f"- {f.family}: {n}")
        if f.n_failed:
            lines.append(
                f"- {f.family}: {f.n_failed} of {f.n_resamples} resamples failed "
                "to fit and were dropped"
            )
    lines.append("")
    return lines


def _data_lines(cells: Sequence[Cell]) -> list[str]:
    """The seed-aggregated cells the laws were fitted to, as a table."""
    lines = [
        "## Data (seed-aggregated)",
        "",
        "| family | N | D | C | loss mean | loss std | seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c.family} | {_g(c.N)} | {_g(c.D)} | {_g(c.C)} | {c.mean:.4f} | "
            f"{'—' if c.n < 2 else f'{c.std:.4f}'} | {c.n} |"
        )
    lines.append("")
    return lines


def gap_lines(comparison: Comparison) -> list[str]:
    """The report's section on the gaps between families (gpn_scale.scaling.gaps)."""
    ref = comparison.reference
    lvl = comparison.gaps[0].ci_level if comparison.gaps else 0.95
    lines = [
        f"## Gaps against {ref}",
        "",
        f"Each family's fitted law against the reference family '{ref}' (`--reference`): the "
        "loss ratio L_family / L_ref at equal N (from L(N)), at equal C (from L(C)) and at "
        "equal N and D (from L(N,D), where fitted), and the compute multiplier C_family / C "
        f"with L_family(C_family) = L_ref(C) (from L(C)). Above 1: worse than {ref}. "
        f"Brackets: {lvl:.0%} seed-bootstrap intervals (each family's refits, paired "
        "independently). Points: the largest N / C in the data, then the `--at-N` / `--at-C` "
        "targets.",
        "",
        "| family | measure | at | value [CI] |",
        "|---|---|---|---|",
    ]
    for g in comparison.gaps:
        extra = (
            f" ({g.unreachable_fraction:.1%} of resamples unreachable)"
            if g.unreachable_fraction
            else ""
        )
        lines.append(
            f"| {g.family} | {MEASURES[g.measure][1]} | {format_point(g)} | "
            f"{format_value(g)}{extra} |"
        )
    if not comparison.gaps:
        lines.append("| — | no gap could be computed (see the notes below) | | |")
    lines.append("")
    lines += [f"- {n}" for n in comparison.notes]
    lines.append("")
    return lines


def write_outputs(
    out_dir: str | Path,
    fits: Sequence[FitResult],
    notes: Sequence[str],
    collection: Collection,
    settings: dict[str, Any],
    comparison: Comparison | None = None,
) -> dict[str, Path]:
    """fit.json, report.md and the PNGs into `out_dir`; returns their paths by role."""
    from gpn_scale.scaling import plots as P

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cells = aggregate(collection.observations())
    colours = P.family_colours(sorted({c.family for c in cells}))
    paths: dict[str, Path] = {}
    for var in ("N", "C"):
        if any(f.form.key == f"L({var})" for f in fits):
            marks = [  # the points the gaps are evaluated at
                (float(p["at"][var]), str(p["where"]))
                for p in (comparison.points.get(f"L({var})", []) if comparison else [])
            ]
            paths[f"loss_vs_{var}"] = P.plot_loss_vs(
                var, fits, cells, out / f"loss_vs_{var}.png", colours, marks=marks
            )
    for f in fits:
        if f.form.key == "L(N,D)":
            safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in f.family)
            paths[f"loss_vs_D_{f.family}"] = P.plot_loss_vs_tokens(f, out / f"loss_vs_D_{safe}.png")
    if fits:
        paths["residuals"] = P.plot_residuals(fits, out / "residuals.png", colours)
    families = settings.get("families")
    paper = compare_with_paper(
        [r for r in collection.usable if not families or r.family in families],
        float(settings.get("ci_level", 0.95)),
    )
    data = build_json(fits, cells, notes, collection, settings, comparison, paper)
    (out / "fit.json").write_text(json.dumps(_clean(data), indent=1, allow_nan=False))
    paths["json"] = out / "fit.json"
    md = build_markdown(
        fits, cells, notes, collection, settings, list(paths.values()), comparison, paper
    )
    (out / "report.md").write_text(md)
    paths["report"] = out / "report.md"
    return paths


def fit_output_files(out_dir: str | Path) -> list[Path]:
    """The files `write_outputs` writes that are in `out_dir` now: fit.json, report.md and its
    plots (loss_vs_*.png, residuals.png)."""
    out = Path(out_dir)
    if not out.is_dir():
        return []
    names = [out / "fit.json", out / "report.md", out / "residuals.png"]
    found = [p for p in names if p.is_file()]
    return found + sorted(p for p in out.glob("loss_vs_*.png") if p.is_file())


def _clean(o: Any) -> Any:
    """JSON-safe copy: numpy scalars to Python numbers, NaN/inf to null."""
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, (str, bool)) or o is None:
        return o
    if isinstance(o, int):
        return o
    try:
        v = float(o)
    except (TypeError, ValueError):
        return str(o)
    return v if math.isfinite(v) else None
