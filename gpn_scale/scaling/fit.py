"""Scaling-law fits with seed-bootstrap confidence intervals.

Three laws, each fitted per model family on the seed-averaged final held-out loss of every
(family, N, D) cell:

    L(N)    = E + A * N**-alpha                      N: parameters
    L(C)    = E + A * C**-alpha                      C: training FLOPs
    L(N, D) = E + A * N**-alpha + B * D**-beta       D: training tokens (needs D/N to vary)

Protocol (Hoffmann et al. 2022 as replicated by Epoch AI, Besiroglu et al. 2024):
parameters are fitted in log space, theta = (e, a[, b], alpha[, beta]) with E = exp(e),
A = exp(a), B = exp(b); the prediction is log L = logsumexp(a - alpha log N, [b - beta log D,] e),
the objective is the sum of Huber(delta = 1e-3) of (log L_pred - log L_obs) over the cells,
minimised with L-BFGS from a grid of initialisations; the best converged point wins.

Uncertainty: bootstrap over seeds. Each resample draws, inside every cell, as many seeds as
the cell has, with replacement, recomputes the cell means and refits, warm-started from the
full-data optimum and from any other distinct optimum of the full fit whose objective is
within 50% of the best (the competing basins; usually there is none). Refits minimise the
same objective for all resamples at once (a vectorised Levenberg-Marquardt on the Huber
loss's IRLS form, L-BFGS finishing the rare unsettled one): it reaches L-BFGS's optima
(tested) 10-60x faster.
Percentile intervals over >= 1000 resamples are reported for every parameter.

Here: the fit of one law to one family's cells with its bootstrap (`fit_cells`) and of every
law to every family (`fit_observations`). Beside it: fit_law.py (the forms, the grid, the
objective, `FitError`), fit_optimize.py (L-BFGS and the batched refits), fit_data.py
(`Observation`, `Cell`, which cells a law uses and whether they determine it) and
fit_result.py (`FitResult`). The names callers use are importable from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from gpn_scale.scaling.fit_data import (
    Cell,
    Observation,
    aggregate,
    cells_for_form,
    d_varies,
    unidentifiable,
)
from gpn_scale.scaling.fit_law import (
    DEFAULT_GRID,
    DEFAULT_MAX_STARTS,
    FORMS,
    HUBER_DELTA,
    FitError,
    Form,
    get_form,
    grid_points,
    huber,
    log_predict,
    objective,
)
from gpn_scale.scaling.fit_optimize import (
    PointFit,
    _minimize,
    fit_point,
    one_blas_thread,
    refit_batched,
)
from gpn_scale.scaling.fit_result import FitResult

__all__ = [
    "DEFAULT_GRID",
    "DEFAULT_MAX_STARTS",
    "FORMS",
    "HUBER_DELTA",
    "MIN_RESAMPLES",
    "Cell",
    "FitError",
    "FitResult",
    "Form",
    "Observation",
    "PointFit",
    "aggregate",
    "cells_for_form",
    "d_varies",
    "fit_cells",
    "fit_observations",
    "fit_point",
    "get_form",
    "grid_points",
    "huber",
    "log_predict",
    "objective",
    "one_blas_thread",
    "refit_batched",
    "resample_means",
    "unidentifiable",
]

MIN_RESAMPLES = 1000


# ----------------------------------------------------------------------------- fitting


def _check_points(form: Form, family: str, cells: Sequence[Cell]) -> None:
    why = unidentifiable(form, cells)
    if why:
        raise FitError(f"{form.key} fit for family '{family}' {why}")


def resample_means(cells: Sequence[Cell], resamples: int, rng: np.random.Generator) -> np.ndarray:
    """(resamples, n_cells) cell means with the seeds of each cell drawn with replacement."""
    out = np.empty((resamples, len(cells)))
    for j, c in enumerate(cells):
        idx = rng.integers(0, c.n, size=(resamples, c.n))
        out[:, j] = c.losses[idx].mean(axis=1)
    return out


def _bootstrap(
    warm: np.ndarray, logx: np.ndarray, log_means: np.ndarray, delta: float, method: str
) -> np.ndarray:
    """Refit every resample (rows of log_means) from each warm start; keep the best."""
    R = log_means.shape[0]
    best_f = np.full(R, np.inf)
    best_x = np.full((R, warm.shape[1]), np.nan)
    for x0 in warm:
        if method == "batched":
            xs, fs, ok = refit_batched(x0, logx, log_means, delta)
            # rows the vectorised solver did not settle: finish them with L-BFGS
            for i in np.flatnonzero(~ok):
                res = _minimize(xs[i], logx, log_means[i], delta)
                if np.isfinite(res.fun) and res.fun <= fs[i]:
                    xs[i], fs[i] = res.x, res.fun
        elif method == "lbfgs":
            xs = np.full((R, warm.shape[1]), np.nan)
            fs = np.full(R, np.inf)
            for i in range(R):
                res = _minimize(x0, logx, log_means[i], delta)
                if np.isfinite(res.fun) and np.all(np.isfinite(res.x)):
                    xs[i], fs[i] = res.x, res.fun
        else:
            raise FitError(f"unknown bootstrap method '{method}'; use batched or lbfgs")
        better = np.isfinite(fs) & np.all(np.isfinite(xs), axis=1) & (fs < best_f)
        best_f[better] = fs[better]
        best_x[better] = xs[better]
    return best_x


def _warm_starts(
    point: PointFit, boot_starts: int, logx: np.ndarray, logy: np.ndarray, delta: float
) -> list[np.ndarray]:
    """The full-data optimum plus up to boot_starts-1 other distinct optima that compete with
    it (full-data objective within 50% of the best): basins a resample could switch to."""
    out = [point.optima[0]]
    for x in point.optima[1:]:
        if len(out) >= boot_starts:
            break
        if objective(x, logx, logy, delta)[0] <= 1.5 * point.objective + 1e-12:
            out.append(x)
    return out


def fit_cells(
    cells: Sequence[Cell],
    form: Form | str,
    family: str = "",
    *,
    resamples: int = MIN_RESAMPLES,
    seed: int = 0,
    ci_level: float = 0.95,
    grid: Mapping[str, Sequence[float]] | None = None,
    max_starts: int | None = DEFAULT_MAX_STARTS,
    boot_starts: int = 3,
    delta: float = HUBER_DELTA,
    allow_few_resamples: bool = False,
    boot_method: str = "batched",
) -> FitResult:
    """Fit `form` to the cell means, then bootstrap seeds within cells for CIs.

    The full fit is the protocol's L-BFGS from the grid. Resample refits minimise the same
    objective with `refit_batched` (all resamples at once; L-BFGS finishes any it leaves
    unsettled), or, with boot_method="lbfgs", one L-BFGS run per resample and warm start.
    """
    form = get_form(form) if isinstance(form, str) else form
    family = family or (cells[0].family if cells else "")
    _check_points(form, family, cells)
    if resamples < MIN_RESAMPLES and not allow_few_resamples:
        raise FitError(
            f"resamples={resamples} is below the protocol's minimum of {MIN_RESAMPLES}; "
            f"use at least {MIN_RESAMPLES}"
        )
    logx = np.log(np.array([[c.value(v) for c in cells] for v in form.variables]))
    logy = np.log(np.array([c.mean for c in cells]))
    starts = grid_points(form, grid)
    point = fit_point(logx, logy, starts, delta, max_starts)

    # Bootstrap: warm starts = the full-data optimum + the next distinct optima.
    rng = np.random.default_rng(seed)
    means = resample_means(cells, resamples, rng)
    warm = np.array(_warm_starts(point, boot_starts, logx, logy, delta))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"), one_blas_thread():
        boot = _bootstrap(warm, logx, np.log(means), delta, boot_method)
    ok = np.all(np.isfinite(boot), axis=1)
    notes = []
    if len(cells) == form.n_params:
        notes.append(
            f"{len(cells)} points for {form.n_params} parameters: the law interpolates "
            "them (zero residual), so it says nothing about fit quality and no "
            "interval is reported; add sizes/token budgets for a real fit"
        )
    few = [c for c in cells if c.n < 2]
    if few:
        notes.append(
            f"{len(few)} of {len(cells)} cells have a single seed: the bootstrap cannot "
            "see seed noise there, so the intervals are too narrow"
        )
    if not point.converged:
        notes.append("L-BFGS hit its iteration limit on the best start; the optimum may be inexact")
    return FitResult(
        form=form,
        family=family,
        theta=point.theta,
        objective=point.objective,
        n_points=len(cells),
        cells=list(cells),
        boot_thetas=boot[ok],
        n_resamples=resamples,
        n_failed=int((~ok).sum()),
        ci_level=ci_level,
        n_starts=point.n_starts,
        grid_size=len(starts),
        delta=delta,
        notes=notes,
    )


def fit_observations(
    observations: Iterable[Observation],
    *,
    laws: Sequence[str] = ("L(N)", "L(C)", "L(N,D)"),
    families: Sequence[str] | None = None,
    **kwargs: Any,
) -> tuple[list[FitResult], list[str]]:
    """Fit every requested law for every family. A law the family's cells cannot determine
    (too few cells; for L(N,D) one N, one D, or D ∝ N) is skipped with a note and the others
    are fitted; only when none can be is it an error. Returns (fits, notes)."""
    cells = aggregate(observations)
    if not cells:
        raise FitError(
            "no finished runs to fit; check the run directories (DONE markers or "
            "metrics.jsonl with eval/loss)"
        )
    by_family: dict[str, list[Cell]] = {}
    for c in cells:
        by_family.setdefault(c.family, []).append(c)
    if families:
        unknown = [f for f in families if f not in by_family]
        if unknown:
            raise FitError(f"family '{unknown[0]}' has no runs; known: {', '.join(by_family)}")
        by_family = {f: by_family[f] for f in families}
    fits, notes, reasons = [], [], []
    forms = [get_form(law) for law in laws]
    for family, fam_cells in by_family.items():
        for form in forms:
            law_cells = cells_for_form(fam_cells, form)
            why = unidentifiable(form, law_cells)
            if why:  # one law the data cannot determine must not stop the others
                reasons.append(f"{form.key} fit for family '{family}' {why}")
                notes.append(f"{family}: {form.key} skipped: it {why}")
                continue
            fits.append(fit_cells(law_cells, form, family, **kwargs))
    if not fits:
        raise FitError(
            reasons[0]
            if len(reasons) == 1
            else f"none of the laws can be fitted: {'; '.join(reasons)}"
        )
    return fits, notes
