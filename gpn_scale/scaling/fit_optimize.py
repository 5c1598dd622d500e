"""The minimisers of a scaling fit (scaling/fit.py): L-BFGS from the grid's best starts on
the full data (`fit_point`), and the vectorised Levenberg-Marquardt that refits every
bootstrap resample at once (`refit_batched`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpn_scale.scaling.fit_law import (
    DEFAULT_MAX_STARTS,
    HUBER_DELTA,
    FitError,
    _objective_batch,
    huber,
    objective,
)

# ----------------------------------------------------------------------------- L-BFGS


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


# ----------------------------------------------------------------------------- batched refits


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
