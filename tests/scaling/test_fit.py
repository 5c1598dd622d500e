"""The scaling-law fitter: recovery of known laws, CI coverage, grid stability, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpn_scale.core.config import ConfigError
from gpn_scale.scaling import fit as F

# Hoffmann et al.'s published Chinchilla law, used as the ground truth.
TRUE = {"E": 1.69, "A": 406.4, "alpha": 0.34, "B": 410.7, "beta": 0.28}
SIZES = np.geomspace(2e7, 1e9, 6)


def chinchilla(N, D, p=TRUE):
    return p["E"] + p["A"] * N ** -p["alpha"] + p["B"] * D ** -p["beta"]


def synth(law, *, tpp=(20,), seeds=5, noise=0.01, rng_seed=1, family="gpn+m"):
    """Runs of `law(N, D)` with multiplicative log-normal seed noise."""
    rng = np.random.default_rng(rng_seed)
    obs = []
    for N in SIZES:
        for t in tpp:
            D = N * t
            for s in range(seeds):
                loss = law(N, D) * np.exp(rng.normal(0.0, noise))
                obs.append(
                    F.Observation(
                        family, N, D, 6 * N * D, float(loss), s, f"{family}-{N:.0e}-{t}-s{s}"
                    )
                )
    return obs


def assert_truth_inside(fit, truth, max_rel_width):
    for name, value in truth.items():
        lo, hi = fit.ci[name]
        assert lo <= value <= hi, f"{name}: true {value} outside CI [{lo:.4g}, {hi:.4g}]"
        assert (hi - lo) / abs(value) < max_rel_width[name], f"{name}: CI too wide [{lo}, {hi}]"


def test_noise_free_data_is_recovered_exactly():
    cells = F.aggregate(synth(chinchilla, tpp=(5, 10, 20, 40, 80), seeds=1, noise=0.0))
    form = F.get_form("L(N,D)")
    logx = np.log([[c.N for c in cells], [c.D for c in cells]])
    logy = np.log([c.mean for c in cells])
    point = F.fit_point(logx, logy, F.grid_points(form))
    got = F.FitResult._natural(form, point.theta)
    for k, v in TRUE.items():
        assert got[k][0] == pytest.approx(v, rel=2e-3), k


@pytest.mark.slow
def test_chinchilla_law_recovered_within_its_bootstrap_ci():
    obs = synth(chinchilla, tpp=(5, 10, 20, 40, 80), seeds=5, noise=0.01)
    fits, notes = F.fit_observations(obs, laws=["L(N,D)"], resamples=1000, seed=0)
    (fit,) = fits
    assert fit.n_resamples == 1000 and fit.n_failed == 0 and fit.boot_thetas.shape == (1000, 5)
    assert_truth_inside(fit, TRUE, {"E": 0.15, "A": 1.5, "alpha": 0.4, "B": 1.0, "beta": 0.3})
    # derived compute-optimal exponent a = beta / (alpha + beta)
    lo, hi = fit.ci["a_opt"]
    assert lo <= TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"]) <= hi
    json.dumps(fit.to_dict())  # serialisable


def test_loss_vs_params_recovered_within_ci_and_deterministic():
    truth = {"E": 2.1, "A": 60.0, "alpha": 0.3}
    obs = synth(lambda N, D: truth["E"] + truth["A"] * N ** -truth["alpha"], seeds=4, noise=0.004)
    cells = F.cells_for_form(F.aggregate(obs), F.get_form("L(N)"))
    fit = F.fit_cells(cells, "L(N)", resamples=1000, seed=3)
    assert_truth_inside(fit, truth, {"E": 0.1, "A": 3.0, "alpha": 0.5})
    again = F.fit_cells(cells, "L(N)", resamples=1000, seed=3)
    assert again.ci == fit.ci
    # the band brackets the fitted curve and the fitted curve passes near every cell mean
    lo, hi = fit.band(N=SIZES)
    pred = fit.predict(N=SIZES)
    assert np.all(lo <= pred) and np.all(pred <= hi)
    assert np.max(np.abs(fit.residuals())) < 0.01


def test_loss_vs_compute_recovered():
    truth = {"E": 1.8, "A": 30.0, "alpha": 0.08}
    obs = synth(
        lambda N, D: truth["E"] + truth["A"] * (6 * N * D) ** -truth["alpha"], seeds=3, noise=0.002
    )
    (fit,), _ = F.fit_observations(obs, laws=["L(C)"], resamples=1000, seed=0)
    assert_truth_inside(fit, truth, {"E": 0.2, "A": 3.0, "alpha": 1.0})


def test_fit_is_stable_to_the_initialisation_grid():
    obs = synth(chinchilla, tpp=(5, 10, 20, 40, 80), seeds=3, noise=0.01, rng_seed=7)
    cells = F.aggregate(obs)
    form = F.get_form("L(N,D)")
    logx = np.log([[c.N for c in cells], [c.D for c in cells]])
    logy = np.log([c.mean for c in cells])
    grids = [
        None,  # Epoch AI's grid (best 200 of 4500 starts)
        {"e": (-0.8, 0.2, 0.9), "log_coef": (2.0, 9.0, 16.0, 23.0), "exponent": (0.2, 0.7, 1.3)},
        {"e": (0.0,), "log_coef": (0.0, 10.0, 20.0), "exponent": (0.1, 0.6, 1.6)},
    ]
    thetas = [F.fit_point(logx, logy, F.grid_points(form, g), max_starts=100).theta for g in grids]
    for t in thetas[1:]:
        np.testing.assert_allclose(
            F.log_predict(t, logx), F.log_predict(thetas[0], logx), atol=1e-6
        )
        np.testing.assert_allclose(t[3:], thetas[0][3:], atol=2e-4)  # alpha, beta
        np.testing.assert_allclose(np.exp(t[0]), np.exp(thetas[0][0]), rtol=1e-4)  # E


def test_bootstrap_resamples_seeds_within_each_cell():
    cells = [
        F.Cell("f", 1e6, 2e7, 1.2e14, np.array([3.0, 3.1, 3.2])),
        F.Cell("f", 1e7, 2e8, 1.2e16, np.array([2.0, 2.5])),
        F.Cell("f", 1e8, 2e9, 1.2e18, np.array([1.7])),
    ]
    means = F.resample_means(cells, 2000, np.random.default_rng(0))
    assert means.shape == (2000, 3)
    assert means[:, 0].min() >= 3.0 - 1e-9 and means[:, 0].max() <= 3.2 + 1e-9
    assert set(np.round(means[:, 1], 6)) == {2.0, 2.25, 2.5}
    assert np.all(means[:, 2] == 1.7)
    assert abs(means[:, 0].mean() - 3.1) < 0.01


def one_line(err):
    msg = str(err.value)
    assert "\n" not in msg and msg
    return msg


def test_fewer_points_than_parameters_is_a_clear_error():
    obs = [o for o in synth(chinchilla, seeds=3) if o.N in SIZES[:2]]
    with pytest.raises(ConfigError) as err:
        F.fit_observations(obs, laws=["L(N)"], resamples=1000)
    msg = one_line(err)
    assert "L(N) fit for family 'gpn+m' has 2 distinct sizes but 3 parameters" in msg
    obs = [o for o in synth(chinchilla, tpp=(10, 20), seeds=3) if o.N in SIZES[:2]]
    with pytest.raises(F.FitError, match=r"L\(N,D\) fit .* has 4 \(N, D\) cells but 5 parameters"):
        F.fit_observations(obs, laws=["L(N,D)"], resamples=1000)


def test_bad_inputs_are_one_line_errors():
    obs = synth(chinchilla, seeds=3)
    with pytest.raises(F.FitError) as err:
        F.fit_observations(obs + [obs[0]], laws=["L(N)"])
    assert "seed 0 appears twice" in one_line(err)
    bad = F.Observation("gpn", 1e7, 2e8, 1.2e16, float("nan"), 0, "r1")
    with pytest.raises(F.FitError) as err:
        F.fit_observations([bad], laws=["L(N)"])
    assert "run 'r1': loss must be a positive finite number" in one_line(err)
    with pytest.raises(F.FitError) as err:
        F.fit_observations(obs, laws=["L(N)"], resamples=100)
    assert "below the protocol's minimum of 1000" in one_line(err)
    with pytest.raises(F.FitError) as err:
        F.fit_observations(obs, laws=["L(D)"])
    assert "unknown law 'L(D)'" in one_line(err)
    with pytest.raises(F.FitError) as err:
        F.fit_observations([])
    assert "no finished runs" in one_line(err)


def test_chinchilla_skipped_when_tokens_scale_with_params():
    fits, notes = F.fit_observations(
        synth(chinchilla, seeds=3), laws=["L(N)", "L(N,D)"], resamples=20, allow_few_resamples=True
    )
    assert [f.form.key for f in fits] == ["L(N)"]
    assert any("L(N,D) skipped" in n for n in notes)


@pytest.mark.parametrize("law", ["L(N)", "L(N,D)"])
def test_vectorised_bootstrap_refits_reach_the_lbfgs_optima(law):
    """The resample refits (all at once) minimise the protocol's objective at least as well
    as one L-BFGS run per resample, and land on the same parameters."""
    obs = synth(
        chinchilla, tpp=(5, 20, 80) if law == "L(N,D)" else (20,), seeds=3, noise=0.01, rng_seed=11
    )
    form = F.get_form(law)
    cells = F.cells_for_form(F.aggregate(obs), form)
    logx = np.log([[c.value(v) for c in cells] for v in form.variables])
    point = F.fit_point(logx, np.log([c.mean for c in cells]), F.grid_points(form))
    log_means = np.log(F.resample_means(cells, 40, np.random.default_rng(5)))
    xs, fs, settled = F.refit_batched(point.theta, logx, log_means)
    assert settled.mean() > 0.9
    with F.one_blas_thread():
        ref = [F._minimize(point.theta, logx, y, F.HUBER_DELTA) for y in log_means]
    f_ref = np.array([r.fun for r in ref])
    # rows it settled: at least as low as L-BFGS (which sometimes stops early), same point
    assert np.all(fs[settled] <= f_ref[settled] + 1e-8 * (1 + f_ref[settled]))
    same = settled & (np.abs(fs - f_ref) < 1e-8 * (1 + f_ref))
    assert same.mean() > 0.7
    np.testing.assert_allclose(xs[same], np.array([r.x for r in ref])[same], atol=2e-3)
    # the bootstrap finishes unsettled rows with L-BFGS: every row then matches it (up to a
    # flat valley's 1e-6 relative) or beats it
    boot = F._bootstrap(point.theta[None], logx, log_means, F.HUBER_DELTA, "batched")
    f_boot = np.array([F.objective(x, logx, y)[0] for x, y in zip(boot, log_means)])
    assert np.all(f_boot <= f_ref * (1 + 1e-6))


def test_a_law_the_data_cannot_identify_is_skipped_and_the_others_fitted():
    """One token budget for every size (a sweep with `tokens:`): D is constant, so L(N,D)
    cannot be fitted, but L(N) and L(C) can and are."""
    rng = np.random.default_rng(3)
    obs = [
        F.Observation(
            "gpn+m",
            N,
            2e10,
            6 * N * 2e10,
            float(chinchilla(N, 2e10) * np.exp(rng.normal(0, 0.01))),
            s,
            f"r{i}-{s}",
        )
        for i, N in enumerate(SIZES[:3])
        for s in range(3)
    ]
    fits, notes = F.fit_observations(obs, resamples=1000)  # the default laws
    assert [f.form.key for f in fits] == ["L(N)", "L(C)"]
    (note,) = [n for n in notes if "L(N,D)" in n]
    assert note.startswith("gpn+m: L(N,D) skipped: it has one token budget D for all runs")
    with pytest.raises(F.FitError) as err:  # asked alone: nothing to fit
        F.fit_observations(obs, laws=["L(N,D)"], resamples=1000)
    assert "L(N,D) fit for family 'gpn+m' has one token budget D" in one_line(err)


def test_a_fit_with_as_many_points_as_parameters_reports_no_interval():
    from gpn_scale.scaling.collect import Collection
    from gpn_scale.scaling.report import build_markdown

    obs = [o for o in synth(chinchilla, seeds=3) if o.N in SIZES[:3]]
    (fit,), notes = F.fit_observations(obs, laws=["L(N)"], resamples=1000)
    assert fit.n_points == 3 and fit.interpolates
    assert any("interpolates" in n for n in fit.notes)
    d = fit.to_dict()
    assert d["interpolates"] is True
    assert all(p["ci_low"] is None and p["ci_high"] is None for p in d["params"].values())
    md = build_markdown(
        [fit],
        F.aggregate(obs),
        notes,
        Collection(records=[], sources=["x"]),
        {"resamples": 1000, "seed": 0},
        [],
    )
    row = next(line for line in md.splitlines() if line.startswith("| gpn+m |"))
    assert "3 (interpolates)" in row and "[" not in row
    more = [o for o in synth(chinchilla, seeds=3) if o.N in SIZES[:4]]
    (fit4,), _ = F.fit_observations(more, laws=["L(N)"], resamples=1000)
    assert not fit4.interpolates and fit4.to_dict()["params"]["E"]["ci_low"] is not None
