"""PNG plots of scaling fits (matplotlib, Agg backend): loss vs N and vs compute with the
fitted curves and bootstrap bands (one colour per family), L(N, D) per size, residuals."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gpn_scale.scaling.fit import Cell, FitResult

AXIS_LABEL = {"N": "parameters N", "C": "training compute C (FLOPs)", "D": "training tokens D"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def family_colours(families: Sequence[str]) -> dict[str, str]:
    palette = [
        "tab:blue",
        "tab:orange",
        "tab:green",
        "tab:red",
        "tab:purple",
        "tab:brown",
        "tab:pink",
        "tab:gray",
        "tab:olive",
        "tab:cyan",
    ]
    return {f: palette[i % len(palette)] for i, f in enumerate(sorted(families))}


def plot_loss_vs(
    var: str,
    fits: Sequence[FitResult],
    cells: Sequence[Cell],
    path: Path,
    colours: dict[str, str],
    marks: Sequence[tuple[float, str]] = (),
) -> Path:
    """Cell means (error bars: seed std) against N or C, with every family's L(var) fit and
    its band in one plot; `marks` (value, label) are dashed verticals (the points the gaps
    between families are evaluated at), and the curves extend to reach them."""
    plt = _pyplot()
    law = f"L({var})"
    fig, ax = plt.subplots(figsize=(7, 5))
    reach = max((m for m, _ in marks), default=0.0)
    for value, label in dict.fromkeys(marks):
        ax.axvline(value, color="k", ls="--", lw=0.8, alpha=0.6)
        ax.annotate(
            f"{label}: {var}={value:.3g}",
            (value, 0.02),
            xycoords=("data", "axes fraction"),
            rotation=90,
            fontsize=6,
            ha="right",
            va="bottom",
        )
    for family in sorted({c.family for c in cells}):
        fam = [c for c in cells if c.family == family]
        col = colours[family]
        fit = next((f for f in fits if f.family == family and f.form.key == law), None)
        used = {(c.N, c.D) for c in fit.cells} if fit else {(c.N, c.D) for c in fam}
        for in_fit in (True, False):
            sel = [c for c in fam if ((c.N, c.D) in used) == in_fit]
            if not sel:
                continue
            ax.errorbar(
                [c.value(var) for c in sel],
                [c.mean for c in sel],
                yerr=[0.0 if c.n < 2 else c.std for c in sel],
                fmt="o",
                color=col,
                ms=4,
                capsize=2,
                alpha=0.85 if in_fit else 0.35,
                mfc=col if in_fit else "none",
                label=f"{family}: runs, mean ± std over seeds"
                if in_fit
                else f"{family}: other token budgets (not in this fit)",
            )
        if fit is None:
            continue
        x = np.array([c.value(var) for c in fit.cells])
        grid = np.geomspace(x.min() / 1.5, max(x.max() * 1.5, reach * 1.1), 200)
        lo, hi = fit.band(**{var: grid})
        p = fit.params
        ax.plot(
            grid,
            fit.predict(**{var: grid}),
            color=col,
            lw=1.6,
            label=f"{family}: E={p['E']:.3g}, A={p['A']:.3g}, α={p['alpha']:.3f}",
        )
        if not fit.interpolates:  # a band from an interpolating fit means nothing
            ax.fill_between(
                grid,
                lo,
                hi,
                color=col,
                alpha=0.18,
                lw=0,
                label=f"{family}: {fit.ci_level:.0%} bootstrap band",
            )
    return _finish_loglog(
        plt, fig, ax, AXIS_LABEL[var], f"loss vs {AXIS_LABEL[var]}: {law} = E + A·{var}^-α", path
    )


def plot_loss_vs_tokens(fit: FitResult, path: Path) -> Path:
    """L(N, D): loss against D, one line (and band) per model size."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    sizes = sorted({c.N for c in fit.cells})
    cmap = plt.get_cmap("viridis")
    for i, n in enumerate(sizes):
        col = cmap(i / max(1, len(sizes) - 1))
        cs = [c for c in fit.cells if c.N == n]
        d = np.array([c.D for c in cs])
        ax.errorbar(
            d,
            [c.mean for c in cs],
            yerr=[0.0 if c.n < 2 else c.std for c in cs],
            fmt="o",
            color=col,
            ms=4,
            capsize=2,
        )
        grid = np.geomspace(d.min() / 1.5, d.max() * 1.5, 100)
        lo, hi = fit.band(N=n, D=grid)
        ax.plot(grid, fit.predict(N=n, D=grid), color=col, lw=1.4, label=f"N={n:.3g}")
        if not fit.interpolates:
            ax.fill_between(grid, lo, hi, color=col, alpha=0.15, lw=0)
    p = fit.params
    return _finish_loglog(
        plt,
        fig,
        ax,
        AXIS_LABEL["D"],
        f"{fit.family}: L(N,D): E={p['E']:.3g}, α={p['alpha']:.3f}, β={p['beta']:.3f}",
        path,
    )


def _finish_loglog(plt, fig, ax, xlabel: str, title: str, path: Path) -> Path:  # noqa: ANN001
    """Log-log axes against the final held-out loss, legend, save as PNG, close."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("final held-out loss")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_residuals(fits: Sequence[FitResult], path: Path, colours: dict[str, str]) -> Path:
    """log L_obs - log L_pred for every fit, one panel per law, against its first variable."""
    plt = _pyplot()
    laws = [law for law in ("L(N)", "L(C)", "L(N,D)") if any(f.form.key == law for f in fits)]
    fig, axes = plt.subplots(
        1, max(1, len(laws)), figsize=(4.5 * max(1, len(laws)), 4), squeeze=False
    )
    for ax, law in zip(axes[0], laws):
        for fit in (f for f in fits if f.form.key == law):
            var = fit.form.variables[0]
            x = [c.value(var) for c in fit.cells]
            ax.plot(x, fit.residuals(), "o", color=colours[fit.family], ms=4, label=fit.family)
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(AXIS_LABEL[fit.form.variables[0]] if fits else "")
        ax.set_ylabel("log L_obs − log L_pred")
        ax.set_title(f"residuals of {law}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
