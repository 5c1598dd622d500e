"""A fitted law (scaling/fit.py): its parameters with their bootstrap intervals, its
predictions with their band, its residuals and its fit.json entry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpn_scale.scaling.fit_data import Cell
from gpn_scale.scaling.fit_law import HUBER_DELTA, FitError, Form, log_predict

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
