"""The laws a scaling fit fits (scaling/fit.py): their forms, the protocol's initialisation
grid and the objective, the sum of Huber(delta) of the log-space residuals of
log L = logsumexp(a - alpha log N, [b - beta log D,] e), with its gradient."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gpn_scale.core.config import ConfigError

HUBER_DELTA = 1e-3


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
