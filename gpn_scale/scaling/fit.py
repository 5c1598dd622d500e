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
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpn_scale.core.config import ConfigError

HUBER_DELTA = 1e-3
MIN_RESAMPLES = 1000


class FitError(ConfigError):
    """The data cannot support the requested fit; the message names the problem and the fix."""


# ----------------------------------------------------------------------------- forms


@dataclass(frozen=True)
class Form:
    """A law E + sum_i A_i * x_i**-alpha_i over the variables `variables` (e.g. ("N", "D"))."""

    key: str  # "L(N)", "L(C)", "L(N,D)"
    variables: tuple[str, ...]
    coef_names: tuple[str, ...]  # names of the A_i
    exp_names: tuple[str, ...]  # names of the alpha_i

    @property
    def n_params(self) -> int:
        return 1 + 2 * len(self.variables)

    def formula(self) -> str:
        terms = " + ".join(
            f"{c}·{v}^-{e}" for c, v, e in zip(self.coef_names, self.variables, self.exp_names)
        )
        return f"{self.key} = E + {terms}"


FORMS: dict[str, Form] = {
    "L(N)": Form("L(N)", ("N",), ("A",), ("alpha",)),
    "L(C)": Form("L(C)", ("C",), ("A",), ("alpha",)),
    "L(N,D)": Form("L(N,D)", ("N", "D"), ("A", "B"), ("alpha", "beta")),
}


def get_form(key: str) -> Form:
    norm = key.replace(" ", "")
    if norm not in FORMS:
        raise FitError(f"unknown law '{key}'; choose one of {', '.join(FORMS)}")
    return FORMS[norm]


# Epoch AI's initialisation grid: e in -1..1 step .5, log-coefficients 0..25 step 5,
# exponents 0..2 step .5 (150 starts for one variable, 4500 for two).
DEFAULT_GRID: dict[str, tuple[float, ...]] = {
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0),
    "log_coef": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "exponent": (0.0, 0.5, 1.0, 1.5, 2.0),
}
# L-BFGS runs from the `max_starts` grid points with the lowest initial objective
# (all of them when the grid is that small).
DEFAULT_MAX_STARTS = 200


def grid_points(form: Form, grid: Mapping[str, Sequence[float]] | None = None) -> np.ndarray:
    """All initial theta vectors (rows) of the grid for `form`, in theta order."""
    g = dict(DEFAULT_GRID)
    if grid:
        unknown = set(grid) - set(DEFAULT_GRID)
        if unknown:
            raise FitError(f"unknown grid key '{sorted(unknown)[0]}'; use e, log_coef, exponent")
        g.update({k: tuple(v) for k, v in grid.items()})
    m = len(form.variables)
    axes = [g["e"]] + [g["log_coef"]] * m + [g["exponent"]] * m
    return np.array(list(itertools.product(*axes)), dtype=float)


# ----------------------------------------------------------------------------- objective


def log_predict(theta: np.ndarray, logx: np.ndarray) -> np.ndarray:
    """log L_pred for theta (..., 1+2m) at log-variables logx (m, n); returns (..., n)."""
    theta = np.asarray(theta, dtype=float)
    m = logx.shape[0]
    e = theta[..., :1, None]  # (..., 1, 1)
    a = theta[..., 1 : 1 + m, None]  # (..., m, 1)
    al = theta[..., 1 + m :, None]  # (..., m, 1)
    terms = np.concatenate(
        [a - al * logx, np.broadcast_to(e, a.shape[:-2] + (1, logx.shape[1]))], axis=-2
    )
    mx = terms.max(axis=-2, keepdims=True)
    return (mx + np.log(np.exp(terms - mx).sum(axis=-2, keepdims=True)))[..., 0, :]


def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    ar = np.abs(r)
    return np.where(ar <= delta, 0.5 * r * r, delta * (ar - 0.5 * delta))


def objective(
    theta: np.ndarray, logx: np.ndarray, logy: np.ndarray, delta: float = HUBER_DELTA
) -> tuple[float, np.ndarray]:
    """Sum of Huber(log L_pred - log L_obs) divided by delta (same minimiser, gradients of
    order one so L-BFGS's tolerances mean something), and its gradient."""
    m = logx.shape[0]
    e, a, al = theta[0], theta[1 : 1 + m], theta[1 + m :]
    terms = np.empty((m + 1, logy.size))
    terms[:m] = a[:, None] - al[:, None] * logx
    terms[m] = e
    mx = terms.max(axis=0)
    w = np.exp(terms - mx)
    s = w.sum(axis=0)
    p = w / s  # softmax weights = d lse / d term
    r = mx + np.log(s) - logy
    ar = np.abs(r)
    quad = ar <= delta
    h = np.where(quad, 0.5 * r * r, delta * (ar - 0.5 * delta))
    dh = np.where(quad, r, delta * np.sign(r))
    # elementwise products + sums, not `@`: BLAS threads make these tiny products ~10x slower
    grad = np.empty_like(theta)
    grad[0] = (dh * p[m]).sum()
    pd = p[:m] * dh
    grad[1 : 1 + m] = pd.sum(axis=1)
    grad[1 + m :] = -(pd * logx).sum(axis=1)
    return float(h.sum() / delta), grad / delta


def _objective_batch(
    thetas: np.ndarray, logx: np.ndarray, logy: np.ndarray, delta: float
) -> np.ndarray:
    r = log_predict(thetas, logx) - logy
    return huber(r, delta).sum(axis=-1) / delta


_LBFGS_OPTIONS = {"maxiter": 5000, "ftol": 1e-14, "gtol": 1e-9}


def _minimize(theta0: np.ndarray, logx: np.ndarray, logy: np.ndarray, delta: float):
    from scipy.optimize import minimize

    return minimize(
        objective,
        np.asarray(theta0, dtype=float),
        args=(logx, logy, delta),
        jac=True,
        method="L-BFGS-B",
        options=_LBFGS_OPTIONS,
    )


@dataclass
class PointFit:
    """The best of several L-BFGS runs on one data set."""

    theta: np.ndarray
    objective: float  # sum of Huber terms (in units of delta)
    optima: list[np.ndarray]  # distinct converged points, best first
    n_starts: int
    converged: bool


def one_blas_thread():
    """Context manager: BLAS on one thread. scipy's L-BFGS-B does tiny vector operations
    through BLAS, and with a thread pool (on a busy machine) each call gets ~7x slower."""
    import scipy.optimize  # noqa: F401  load its BLAS first: limits miss libraries loaded later
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=1, user_api="blas")


def fit_point(
    logx: np.ndarray,
    logy: np.ndarray,
    starts: np.ndarray,
    delta: float = HUBER_DELTA,
    max_starts: int | None = DEFAULT_MAX_STARTS,
) -> PointFit:
    """Run L-BFGS from the rows of `starts` (the `max_starts` with the lowest initial objective
    when there are more) and return the best converged point plus the distinct optima."""
    with one_blas_thread():
        return _fit_point(logx, logy, starts, delta, max_starts)


def _fit_point(
    logx: np.ndarray, logy: np.ndarray, starts: np.ndarray, delta: float, max_starts: int | None
) -> PointFit:
    starts = np.atleast_2d(np.asarray(starts, dtype=float))
    if max_starts is not None and len(starts) > max_starts:
        f0 = _objective_batch(starts, logx, logy, delta)
        f0 = np.where(np.isfinite(f0), f0, np.inf)
        starts = starts[np.argsort(f0, kind="stable")[:max_starts]]
    results = []
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for x0 in starts:
            res = _minimize(x0, logx, logy, delta)
            if np.isfinite(res.fun) and np.all(np.isfinite(res.x)):
                results.append(res)
    if not results:
        raise FitError(
            "every L-BFGS start failed (non-finite loss); check the losses are positive and finite"
        )
    results.sort(key=lambda r: r.fun)
    optima: list[np.ndarray] = []
    for res in results:
        if all(np.max(np.abs(res.x - o)) > 1e-3 for o in optima):
            optima.append(res.x.copy())
        if len(optima) >= 8:
            break
    best = results[0]
    return PointFit(
        theta=best.x.copy(),
        objective=float(best.fun),
        optima=optima,
        # status 1 = iteration limit; 2 (line search could not improve at
        # machine precision) is the usual ending on a Huber objective
        n_starts=len(starts),
        converged=int(best.status) != 1,
    )


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Observation:
    """One finished run: its family, size, tokens, compute, seed and final held-out loss."""

    family: str
    N: float
    D: float
    C: float
    loss: float
    seed: int | None = None
    run: str = ""


@dataclass
class Cell:
    """All seeds of one (family, N, D) configuration."""

    family: str
    N: float
    D: float
    C: float
    losses: np.ndarray
    runs: tuple[str, ...] = ()

    @property
    def n(self) -> int:
        return int(self.losses.size)

    @property
    def mean(self) -> float:
        return float(self.losses.mean())

    @property
    def std(self) -> float:
        return float(self.losses.std(ddof=1)) if self.n > 1 else float("nan")

    def value(self, var: str) -> float:
        return float(getattr(self, var))


def aggregate(observations: Iterable[Observation]) -> list[Cell]:
    """Group runs into (family, N, D) cells (seeds aggregated); sorted by family, N, D."""
    groups: dict[tuple[str, float, float], list[Observation]] = {}
    for ob in observations:
        for var in ("N", "D", "C", "loss"):
            v = getattr(ob, var)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise FitError(
                    f"run '{ob.run or '?'}': {var} must be a positive finite number, "
                    f"got {v!r}; fix or drop that run"
                )
        groups.setdefault((ob.family, float(ob.N), float(ob.D)), []).append(ob)
    cells = []
    for (family, n_, d_), obs in sorted(groups.items()):
        seeds = [o.seed for o in obs if o.seed is not None]
        if len(seeds) != len(set(seeds)):
            dup = next(s for s in seeds if seeds.count(s) > 1)
            names = [o.run for o in obs if o.seed == dup]
            raise FitError(
                f"family '{family}' N={n_:.4g} D={d_:.4g}: seed {dup} appears twice "
                f"({', '.join(names)}); drop the duplicate run"
            )
        cells.append(
            Cell(
                family,
                n_,
                d_,
                float(np.mean([o.C for o in obs])),
                np.array([o.loss for o in obs], dtype=float),
                tuple(o.run for o in obs),
            )
        )
    return cells


def d_varies(cells: Sequence[Cell], tolerance: float = 0.05) -> bool:
    """True when tokens-per-parameter differs between cells (else D ∝ N and L(N,D) is
    not identifiable)."""
    ratios = [c.D / c.N for c in cells]
    return bool(ratios) and max(ratios) / min(ratios) > 1.0 + tolerance


def cells_for_form(cells: Sequence[Cell], form: Form) -> list[Cell]:
    """L(N,D) uses every cell; L(N) and L(C) use one cell per N (the largest D, i.e. the
    longest-trained runs) so that they stay functions of a single variable."""
    if form.key == "L(N,D)":
        return list(cells)
    by_n: dict[float, Cell] = {}
    for c in cells:
        if c.N not in by_n or c.D > by_n[c.N].D:
            by_n[c.N] = c
    return [by_n[k] for k in sorted(by_n)]


# ----------------------------------------------------------------------------- results


@dataclass
class FitResult:
    form: Form
    family: str
    theta: np.ndarray
    objective: float
    n_points: int
    cells: list[Cell]
    boot_thetas: np.ndarray  # (R_ok, n_params) thetas of the successful resamples
    n_resamples: int
    n_failed: int
    ci_level: float
    n_starts: int
    grid_size: int
    delta: float = HUBER_DELTA
    notes: list[str] = field(default_factory=list)

    # -- parameters -----------------------------------------------------------------------
    @staticmethod
    def _natural(form: Form, thetas: np.ndarray) -> dict[str, np.ndarray]:
        thetas = np.atleast_2d(thetas)
        m = len(form.variables)
        out = {"E": np.exp(thetas[:, 0])}
        for i, name in enumerate(form.coef_names):
            out[name] = np.exp(thetas[:, 1 + i])
        for i, name in enumerate(form.exp_names):
            out[name] = thetas[:, 1 + m + i]
        if form.key == "L(N,D)":
            s = out["alpha"] + out["beta"]
            with np.errstate(divide="ignore", invalid="ignore"):
                # compute-optimal allocation with C ∝ N·D: N_opt ∝ C^a, D_opt ∝ C^b
                out["a_opt"] = out["beta"] / s
                out["b_opt"] = out["alpha"] / s
        return out

    @property
    def params(self) -> dict[str, float]:
        return {k: float(v[0]) for k, v in self._natural(self.form, self.theta).items()}

    @property
    def interpolates(self) -> bool:
        """As many points as parameters: the curve passes through every point, whatever the
        noise, so the resample refits move with the noise and their spread is no interval."""
        return self.n_points <= self.form.n_params

    @property
    def boot_params(self) -> dict[str, np.ndarray]:
        return self._natural(self.form, self.boot_thetas)

    @property
    def ci(self) -> dict[str, tuple[float, float]]:
        lo_q, hi_q = 50 * (1 - self.ci_level), 50 * (1 + self.ci_level)
        out = {}
        for k, v in self.boot_params.items():
            v = v[np.isfinite(v)]
            out[k] = (
                (float(np.percentile(v, lo_q)), float(np.percentile(v, hi_q)))
                if v.size
                else (float("nan"), float("nan"))
            )
        return out

    # -- predictions ----------------------------------------------------------------------
    def _logx(self, **variables: Any) -> tuple[np.ndarray, tuple[int, ...]]:
        missing = [v for v in self.form.variables if v not in variables]
        if missing:
            raise FitError(f"{self.form.key} needs {', '.join(missing)} to predict")
        arrays = np.broadcast_arrays(
            *[np.asarray(variables[v], dtype=float) for v in self.form.variables]
        )
        return np.log(np.vstack([a.ravel() for a in arrays])), arrays[0].shape

    def predict(self, **variables: Any) -> np.ndarray:
        logx, shape = self._logx(**variables)
        return np.exp(log_predict(self.theta, logx)).reshape(shape)

    def band(self, **variables: Any) -> tuple[np.ndarray, np.ndarray]:
        """Pointwise percentile band of the prediction over the bootstrap fits."""
        logx, shape = self._logx(**variables)
        preds = np.exp(log_predict(self.boot_thetas, logx))
        lo_q, hi_q = 50 * (1 - self.ci_level), 50 * (1 + self.ci_level)
        return (
            np.percentile(preds, lo_q, axis=0).reshape(shape),
            np.percentile(preds, hi_q, axis=0).reshape(shape),
        )

    def residuals(self) -> np.ndarray:
        """log L_obs - log L_pred per cell (cell order)."""
        logx = np.log(np.array([[c.value(v) for c in self.cells] for v in self.form.variables]))
        logy = np.log(np.array([c.mean for c in self.cells]))
        return logy - log_predict(self.theta, logx)

    def to_dict(self) -> dict[str, Any]:
        ci = self.ci
        return {
            "law": self.form.key,
            "formula": self.form.formula(),
            "family": self.family,
            # no interval where the fit interpolates (see `interpolates`)
            "params": {
                k: {
                    "value": v,
                    "ci_low": None if self.interpolates else ci[k][0],
                    "ci_high": None if self.interpolates else ci[k][1],
                }
                for k, v in self.params.items()
            },
            "ci_level": self.ci_level,
            "n_points": self.n_points,
            "interpolates": self.interpolates,
            "huber_objective": self.objective * self.delta,
            "rms_log_residual": float(np.sqrt(np.mean(self.residuals() ** 2))),
            "bootstrap": {"resamples": self.n_resamples, "failed": self.n_failed},
            "optimizer": {
                "method": "L-BFGS-B",
                "huber_delta": self.delta,
                "grid_size": self.grid_size,
                "starts": self.n_starts,
            },
            "points": [
                {
                    "N": c.N,
                    "D": c.D,
                    "C": c.C,
                    "loss_mean": c.mean,
                    "loss_std": None if c.n < 2 else c.std,
                    "n": c.n,
                }
                for c in self.cells
            ],
            "notes": list(self.notes),
        }


# ----------------------------------------------------------------------------- fitting


def _check_points(form: Form, family: str, cells: Sequence[Cell]) -> None:
    why = unidentifiable(form, cells)
    if why:
        raise FitError(f"{form.key} fit for family '{family}' {why}")


def unidentifiable(form: Form, cells: Sequence[Cell]) -> str | None:
    """Why the cells cannot determine every parameter of `form` ("has ...; fix"), or None."""
    if form.key == "L(N,D)":
        if len({c.N for c in cells}) < 2:
            return (
                "has one model size N for all runs, so A and alpha are not identifiable; "
                "add sizes to the sweep or drop this law"
            )
        if len({c.D for c in cells}) < 2:
            return (
                "has one token budget D for all runs, so B and beta are not identifiable; "
                "vary the token budget in the sweep or drop this law"
            )
        if not d_varies(cells):
            return (
                "has the same tokens per parameter for all runs (D ∝ N), so B and beta "
                "are not identifiable; vary tokens_per_param in the sweep or drop this law"
            )
    if len(cells) < form.n_params:
        what = "distinct sizes" if form.key != "L(N,D)" else "(N, D) cells"
        return (
            f"has {len(cells)} {what} but {form.n_params} parameters; add sizes/token "
            "budgets to the sweep or drop this family or law from the fit"
        )
    return None


def resample_means(cells: Sequence[Cell], resamples: int, rng: np.random.Generator) -> np.ndarray:
    """(resamples, n_cells) cell means with the seeds of each cell drawn with replacement."""
    out = np.empty((resamples, len(cells)))
    for j, c in enumerate(cells):
        idx = rng.integers(0, c.n, size=(resamples, c.n))
        out[:, j] = c.losses[idx].mean(axis=1)
    return out


def refit_batched(
    theta0: np.ndarray,
    logx: np.ndarray,
    logy: np.ndarray,
    delta: float = HUBER_DELTA,
    max_iter: int = 300,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Minimise the same Huber objective for many data sets at once (rows of logy, (R, n)),
    all from theta0: a vectorised Levenberg-Marquardt on the IRLS form of the Huber loss
    (gradient J^T psi(r), curvature J^T W J with W = 1 inside delta and delta/|r| outside,
    a majoriser of the Huber curvature), each row with its own damping; a step is kept only
    if it lowers that row's objective. Returns (thetas, objectives / delta, converged)."""
    R, n = logy.shape
    m = logx.shape[0]
    p = 1 + 2 * m
    th = np.array(np.broadcast_to(np.asarray(theta0, dtype=float), (R, p)))

    def predict(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        terms = np.empty((t.shape[0], m + 1, n))
        terms[:, :m] = t[:, 1 : 1 + m, None] - t[:, 1 + m :, None] * logx[None]
        terms[:, m] = t[:, :1]
        mx = terms.max(axis=1, keepdims=True)
        w = np.exp(terms - mx)
        s = w.sum(axis=1, keepdims=True)
        return (mx + np.log(s))[:, 0], w / s

    f = huber(predict(th)[0] - logy, delta).sum(axis=1) / delta
    lam = np.full(R, 1e-4)
    done = np.zeros(R, dtype=bool)
    rows = np.arange(R)
    eye = np.eye(p)
    for _ in range(max_iter):
        act = rows[~done]
        if act.size == 0:
            break
        lse, P = predict(th[act])
        r = lse - logy[act]
        J = np.empty((act.size, n, p))
        J[:, :, 0] = P[:, m]
        J[:, :, 1 : 1 + m] = P[:, :m].transpose(0, 2, 1)
        J[:, :, 1 + m :] = -(P[:, :m] * logx[None]).transpose(0, 2, 1)
        ar = np.abs(r)
        inside = ar <= delta
        psi = np.where(inside, r, delta * np.sign(r)) / delta
        wts = np.where(inside, 1.0, delta / np.maximum(ar, 1e-300)) / delta
        g = np.einsum("anp,an->ap", J, psi)
        H = np.einsum("anp,an,anq->apq", J, wts, J)
        damp = lam[act, None] * (np.einsum("app->ap", H) + 1e-12)
        try:
            step = -np.linalg.solve(H + damp[:, :, None] * eye, g[..., None])[..., 0]
        except np.linalg.LinAlgError:  # a singular row: fall back to a small gradient step
            step = -1e-3 * g
        cand = th[act] + step
        f_new = huber(predict(cand)[0] - logy[act], delta).sum(axis=1) / delta
        ok = np.isfinite(f_new) & (f_new <= f[act])
        gain = np.where(ok, f[act] - f_new, 0.0)
        th[act[ok]] = cand[ok]
        f[act[ok]] = f_new[ok]
        lam[act[ok]] *= 0.3
        lam[act[~ok]] *= 10.0
        settled = ok & (gain <= 1e-13 * (1.0 + f[act])) & (np.abs(step).max(axis=1) < 1e-7)
        done[act[settled | (lam[act] > 1e12)]] = True
    return th, f, done


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
