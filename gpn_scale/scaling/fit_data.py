"""What a scaling fit is fitted to (scaling/fit.py): the finished runs (`Observation`),
their seeds aggregated into (family, N, D) cells (`Cell`), the cells each law uses and
whether they determine its parameters."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from gpn_scale.scaling.fit_law import FitError, Form

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
