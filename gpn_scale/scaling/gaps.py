"""Gaps between families' fitted laws, with seed-bootstrap intervals.

For a family F and the reference family R (GPN+M by default), at a stated point:

    loss ratio at equal N     L_F(N) / L_R(N)             from the L(N) fits
    loss ratio at equal C     L_F(C) / L_R(C)             from the L(C) fits
    loss ratio at equal N, D  L_F(N, D) / L_R(N, D)       from the L(N, D) fits, where fitted
    compute multiplier        C_F / C, where L_F(C_F) = L_R(C): how much compute F needs to
                              reach the loss R reaches with C (from the L(C) fits; infinite
                              when R's loss at C is at or below F's irreducible loss E_F)

A ratio or multiplier above 1 means F is worse than the reference there.

Intervals: each family's fit carries its own seed-bootstrap refits (FitResult.boot_thetas).
The two families' data are independent, so a resample of the gap pairs a refit of F with a
refit of R drawn independently: both sides are shuffled with one seeded generator before
pairing (the fits resample each family with the same RNG seed, so pairing refit i with
refit i would correlate families whose cells have the same shape). The interval is the
percentile interval of the gap over those pairs (inverted-CDF quantiles: no interpolation,
so an infinite multiplier in the tail is reported as such). A fit that interpolates its
points has no interval (FitResult.interpolates) and neither has a gap that uses it.

The maths are pure functions of the laws' theta vectors (gpn_scale.scaling.fit's log-space
parameters) so they are tested on laws with known answers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpn_scale.scaling.fit import (
    Cell,
    FitError,
    FitResult,
    cells_for_form,
    get_form,
    log_predict,
    unidentifiable,
)

DEFAULT_REFERENCE = "gpn+m"

MEASURES = {
    "loss_ratio_N": ("L(N)", "loss ratio at equal N"),
    "loss_ratio_C": ("L(C)", "loss ratio at equal C"),
    "loss_ratio_ND": ("L(N,D)", "loss ratio at equal N and D"),
    "compute_multiplier": ("L(C)", "compute multiplier (compute to reach the reference's loss)"),
}


# ----------------------------------------------------------------------------- pure maths


def _logx(point: Mapping[str, float], variables: Sequence[str]) -> np.ndarray:
    return np.log(np.array([[float(point[v])] for v in variables]))


def loss_ratio(
    theta_f: np.ndarray, theta_r: np.ndarray, variables: Sequence[str], point: Mapping[str, float]
) -> np.ndarray:
    """L_F(point) / L_R(point) for theta rows (..., p) of the same law over `variables`."""
    logx = _logx(point, variables)
    return np.exp(log_predict(theta_f, logx)[..., 0] - log_predict(theta_r, logx)[..., 0])


def compute_multiplier(theta_f: np.ndarray, theta_r: np.ndarray, C: float) -> np.ndarray:
    """C_F / C with L_F(C_F) = L_R(C), for L(C) theta rows (e, a, alpha); inf where F never
    reaches that loss (L_R(C) <= E_F, or alpha_F <= 0 with L_R(C) below L_F's value)."""
    theta_f = np.asarray(theta_f, dtype=float)
    target = np.exp(log_predict(theta_r, _logx({"C": C}, ("C",)))[..., 0])
    e_f, a_f, alpha_f = theta_f[..., 0], theta_f[..., 1], theta_f[..., 2]
    gap = target - np.exp(e_f)  # what F's power-law term must come down to
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_cf = (a_f - np.log(gap)) / alpha_f
        out = np.exp(log_cf - math.log(C))
    return np.where((gap > 0) & (alpha_f > 0) & np.isfinite(out), out, np.inf)


def interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    """Percentile interval of bootstrap samples (inverted CDF: infinities stay infinite)."""
    s = np.asarray(samples, dtype=float)
    s = s[~np.isnan(s)]
    if s.size == 0:
        return float("nan"), float("nan")
    lo, hi = np.quantile(s, [(1 - level) / 2, (1 + level) / 2], method="inverted_cdf")
    return float(lo), float(hi)


def paired_resamples(
    boot_f: np.ndarray, boot_r: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Independent pairs of the two families' bootstrap refits (see the module docstring)."""
    n = min(len(boot_f), len(boot_r))
    return boot_f[rng.permutation(len(boot_f))[:n]], boot_r[rng.permutation(len(boot_r))[:n]]


# ----------------------------------------------------------------------------- results


@dataclass
class Gap:
    """One gap: family vs reference, one measure, at one point."""

    family: str
    reference: str
    measure: str  # a key of MEASURES
    law: str
    point: dict[str, float]
    where: str  # "largest in sweep" | "target"
    value: float  # inf: unreachable
    ci_low: float | None  # None: no interval (an interpolating fit)
    ci_high: float | None
    ci_level: float
    n_resamples: int
    unreachable_fraction: float = 0.0  # of the resamples (compute multiplier only)
    extrapolated: bool = False  # the point lies beyond the fitted range of either family

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "reference": self.reference,
            "measure": self.measure,
            "description": MEASURES[self.measure][1],
            "law": self.law,
            "at": dict(self.point),
            "where": self.where,
            "value": self.value,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "ci_level": self.ci_level,
            "resamples": self.n_resamples,
            "unreachable_fraction": self.unreachable_fraction,
            "extrapolated": self.extrapolated,
        }


@dataclass
class Comparison:
    reference: str
    points: dict[str, list[dict[str, Any]]]  # law -> [{"where", "at"}]
    gaps: list[Gap]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "points": self.points,
            "gaps": [g.to_dict() for g in self.gaps],
            "notes": list(self.notes),
        }


# ----------------------------------------------------------------------------- comparing


def choose_reference(families: Sequence[str], reference: str | None) -> str:
    """The reference family: the one asked for (it must have runs), else GPN+M when present,
    else the first family in sorted order."""
    if reference is not None:
        if reference not in families:
            raise FitError(
                f"--reference: family '{reference}' has no runs; known: {', '.join(families)}"
            )
        return reference
    return DEFAULT_REFERENCE if DEFAULT_REFERENCE in families else sorted(families)[0]


def evaluation_points(
    cells: Sequence[Cell],
    laws: Sequence[str],
    *,
    at_N: Sequence[float] = (),
    at_C: Sequence[float] = (),
) -> dict[str, list[dict[str, Any]]]:
    """Per law, the points gaps are evaluated at: the largest value in the data (over every
    family, so all rows of a law share one point), then the targets given."""
    out: dict[str, list[dict[str, Any]]] = {}
    if not cells:
        return out
    big_n, big_c = max(c.N for c in cells), max(c.C for c in cells)
    for law in laws:
        key = get_form(law).key
        if key == "L(N)":
            pts = [{"where": "largest in sweep", "at": {"N": big_n}}]
            pts += [{"where": "target", "at": {"N": float(n)}} for n in at_N]
        elif key == "L(C)":
            pts = [{"where": "largest in sweep", "at": {"C": big_c}}]
            pts += [{"where": "target", "at": {"C": float(c)}} for c in at_C]
        else:  # L(N,D): the largest-N cell's (N, D), the longest-trained one
            top = max((c for c in cells if c.N == big_n), key=lambda c: c.D)
            pts = [{"where": "largest in sweep", "at": {"N": top.N, "D": top.D}}]
        out[key] = pts
    return out


def _in_range(fit: FitResult, point: Mapping[str, float]) -> bool:
    return all(
        min(c.value(v) for c in fit.cells) <= point[v] <= max(c.value(v) for c in fit.cells)
        for v in fit.form.variables
    )


def gap(
    fit_f: FitResult,
    fit_r: FitResult,
    measure: str,
    point: Mapping[str, float],
    *,
    where: str = "",
    rng: np.random.Generator | None = None,
) -> Gap:
    """One gap of fit_f against fit_r (same law) at `point`, with its bootstrap interval."""
    law, _ = MEASURES[measure]
    if fit_f.form.key != law or fit_r.form.key != law:
        raise FitError(f"{measure} needs two {law} fits, got {fit_f.form.key}/{fit_r.form.key}")
    rng = rng if rng is not None else np.random.default_rng(0)

    def stat(tf: np.ndarray, tr: np.ndarray) -> np.ndarray:
        if measure == "compute_multiplier":
            return compute_multiplier(tf, tr, float(point["C"]))
        return loss_ratio(tf, tr, fit_f.form.variables, point)

    value = float(np.asarray(stat(fit_f.theta, fit_r.theta)))
    bf, br = paired_resamples(fit_f.boot_thetas, fit_r.boot_thetas, rng)
    samples = stat(bf, br) if len(bf) else np.array([])
    level = min(fit_f.ci_level, fit_r.ci_level)
    lo: float | None
    hi: float | None
    if fit_f.interpolates or fit_r.interpolates or not len(samples):
        lo = hi = None
    else:
        lo, hi = interval(samples, level)
    return Gap(
        family=fit_f.family,
        reference=fit_r.family,
        measure=measure,
        law=law,
        point={k: float(v) for k, v in point.items()},
        where=where,
        value=value,
        ci_low=lo,
        ci_high=hi,
        ci_level=level,
        n_resamples=int(len(samples)),
        unreachable_fraction=float(np.mean(np.isinf(samples))) if len(samples) else 0.0,
        extrapolated=not (_in_range(fit_f, point) and _in_range(fit_r, point)),
    )


def compare(
    fits: Sequence[FitResult],
    cells: Sequence[Cell],
    *,
    reference: str | None = None,
    at_N: Sequence[float] = (),
    at_C: Sequence[float] = (),
    seed: int = 0,
) -> Comparison | None:
    """Every family's gaps against the reference at the evaluation points; None with fewer
    than two families. A family (or the reference) without a fit of a law gets no gap on it,
    and the notes say why once (the reason the law is not identifiable from its cells)."""
    for name, values in (("--at-N", at_N), ("--at-C", at_C)):
        bad = [v for v in values if not (math.isfinite(v) and v > 0)]
        if bad:
            raise FitError(f"{name}: a positive finite number, got {bad[0]!r}")
    families = sorted({c.family for c in cells})
    if len(families) < 2:
        if reference is not None:
            choose_reference(families, reference)  # still reject an unknown name
        return None
    ref = choose_reference(families, reference)
    laws = list(dict.fromkeys(f.form.key for f in fits))
    by = {(f.family, f.form.key): f for f in fits}
    points = evaluation_points(cells, laws, at_N=at_N, at_C=at_C)
    rng = np.random.default_rng(seed)
    gaps: list[Gap] = []
    notes: list[str] = []

    def why_missing(family: str, law: str) -> str:
        fam_cells = [c for c in cells if c.family == family]
        form = get_form(law)
        reason = unidentifiable(form, cells_for_form(fam_cells, form))
        return f"its {law} fit {reason}" if reason else f"{law} was not fitted for it"

    for law in laws:
        if (ref, law) not in by:
            notes.append(
                f"no {law} gaps: the reference '{ref}' has no {law} fit: {why_missing(ref, law)}"
            )
            continue
        measures = [m for m, (ml, _) in MEASURES.items() if ml == law]
        for family in families:
            if family == ref:
                continue
            if (family, law) not in by:
                notes.append(f"{family}: no {law} gaps against '{ref}': {why_missing(family, law)}")
                continue
            for pt in points[law]:
                for m in measures:
                    gaps.append(
                        gap(
                            by[(family, law)],
                            by[(ref, law)],
                            m,
                            pt["at"],
                            where=pt["where"],
                            rng=rng,
                        )
                    )
    if any(g.extrapolated for g in gaps):
        notes.append(
            "gaps marked 'extrapolated' are evaluated beyond the fitted range of one of the "
            "two families: they assume the law holds there"
        )
    if any(g.ci_low is None for g in gaps):
        notes.append(
            "gaps without an interval use a fit that interpolates its points (as many points "
            "as parameters): add sizes for an interval"
        )
    return Comparison(reference=ref, points=points, gaps=gaps, notes=notes)


def format_value(g: Gap) -> str:
    """A gap's value and interval as text ("0.9447 [0.9416, 0.9491]", "x0.258 [...]")."""

    def one(x: float | None) -> str:
        if x is None or math.isnan(x):
            return "—"
        if math.isinf(x):
            return "∞"
        return f"{x:.4g}" if g.measure != "compute_multiplier" else f"×{x:.3g}"

    text = one(g.value)
    if g.ci_low is not None:
        text += f" [{one(g.ci_low)}, {one(g.ci_high)}]"
    return text


def format_point(g: Gap) -> str:
    at = ", ".join(f"{k}={v:.3g}" for k, v in g.point.items())
    return f"{at} ({g.where}{', extrapolated' if g.extrapolated else ''})"
