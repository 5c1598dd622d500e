"""`gpn-scale fit` over several families: labels from the model configs, gaps in the report,
the JSON and the one loss-vs-compute plot; runs written the way the trainer leaves them."""

from __future__ import annotations

import csv
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gpn_scale.cli import main
from gpn_scale.scaling.families import family_label
from gpn_scale.scaling.sweep import load_sweep

WIDTHS = (128, 320, 640, 1280)  # d_ffn: four sizes per family (an L(N) fit with a spread)
# L(N) = E + A * N^-alpha per family label (the table family is trained "elsewhere")
LAWS = {
    "gpn+m": (2.0, 300.0, 0.5),
    "gpn+m-2l": (1.95, 300.0, 0.5),
    "gpn": (2.2, 300.0, 0.5),
    "transformer++": (1.9, 300.0, 0.5),
}


def law(family, n):
    E, A, al = LAWS[family]
    return E + A * n**-al


@pytest.fixture
def sweep_path(tmp_path):
    entries = "\n".join(
        f"  - {{config: {cfg}, name: {cfg}-f{w}, model_overrides: {{d_ffn: {w}}}}}"
        for cfg in ("tiny", "tiny_2l", "tiny_gpn")
        for w in WIDTHS
    )
    path = tmp_path / "families.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        name: fam
        seeds: [0, 1, 2]
        data: {{remote: default, seq_len: 64}}
        checkpoint_root: {tmp_path / "ckpt"}
        run_root: {tmp_path / "runs"}
        wandb: {{project: p}}
        hardware: {{gpu: cpu, peak_tflops: 0.1, mfu: 0.2}}
        defaults: {{tokens_per_param: 2, global_batch_size: 2, lr: 1.0e-3, warmup_steps: 1}}
        models:
        """)
        + entries
        + "\n"
    )
    return path


def finish_runs(sweep_path, noise=0.002):
    """DONE in each checkpoint root, config.yaml (model, model_overrides, seed) and
    metrics.jsonl in each run dir: what a finished training run leaves."""
    rng = np.random.default_rng(0)
    runs = load_sweep(sweep_path).runs
    for r in runs:
        loss = law(r.family, r.params) * float(np.exp(rng.normal(0, noise)))
        run_dir, ck = Path(r.run_dir), Path(r.checkpoint_root)
        run_dir.mkdir(parents=True)
        ck.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text(
            json.dumps({"step": r.total_steps, "tokens": r.tokens, "eval/loss": loss}) + "\n"
        )
        overrides = "".join(f"\n  {k}: {v}" for k, v in r.model_overrides)
        (run_dir / "config.yaml").write_text(
            f"model: {r.model}\nmodel_overrides:{overrides}\nseed: {r.seed}\ndata:\n  seq_len: 64\n"
        )
        (ck / "DONE").write_text(
            json.dumps(
                {
                    "step": r.total_steps,
                    "tokens": r.tokens,
                    "final_eval_loss": loss,
                    "params": r.params,
                    "flops": r.flops,
                    "run_dir": r.run_dir,
                }
            )
        )
    return runs


def baseline_table(path, ns):
    rng = np.random.default_rng(1)
    with open(path, "w", newline="") as f:
        f.write("# Transformer++ trained elsewhere\n")
        w = csv.writer(f)
        w.writerow(["family", "N", "D", "loss", "seed"])
        for n in ns:
            for s in range(3):
                loss = law("transformer++", n) * np.exp(rng.normal(0, 0.002))
                w.writerow(["transformer++", n, 2 * n, loss, s])
    return path


def test_family_labels_come_from_the_model_config():
    from gpn_scale.models.registry import load_model_config

    labels = {n: family_label(load_model_config(n)[1]) for n in ("tiny", "tiny_2l", "tiny_gpn")}
    assert labels == {"tiny": "gpn+m", "tiny_2l": "gpn+m-2l", "tiny_gpn": "gpn"}
    assert family_label(load_model_config("tiny", {"n_layers": 3})[1]) == "gpn+m-3l"
    assert family_label(load_model_config("gpn_m_130m_2l")[1]) == "gpn+m-2l"


def test_plan_labels_and_per_family_rows(sweep_path, capsys):
    sweep = load_sweep(sweep_path)
    assert [r.family for r in sweep.runs[::12]] == ["gpn+m", "gpn+m-2l", "gpn"]
    assert {r.registry_family for r in sweep.runs} == {"gpn"}
    wide = next(r for r in sweep.runs if r.size == "tiny-f1280")
    assert "model_overrides.d_ffn=1280" in wide.train_overrides()
    assert wide.params > next(r for r in sweep.runs if r.size == "tiny-f128").params
    assert main(["sweep", "plan", str(sweep_path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["gpn+m"], ["gpn"])]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("gpn+m", "gpn", "4", "12"),
        ("gpn", "gpn", "4", "12"),
    ]
    assert any(line.startswith("gpn+m-2l  ") and " 4    12 " in line for line in out.splitlines())


def test_fit_reports_every_family_and_the_gaps(sweep_path, tmp_path, capsys):
    runs = finish_runs(sweep_path)
    ns = sorted({r.params for r in runs if r.family == "gpn+m"})
    top = max(r.params for r in runs)  # the largest N of any family: every row's point
    table = baseline_table(tmp_path / "baselines.csv", ns)
    out = tmp_path / "fit"
    argv = ["fit", "--sweep", str(sweep_path), "--table", str(table), "--out", str(out)]
    rc = main(argv + ["--laws", "L(N)", "L(C)", "--at-N", "1e7", "--at-C", "1e13"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    data = json.loads((out / "fit.json").read_text())
    fams = {"gpn+m", "gpn+m-2l", "gpn", "transformer++"}
    assert {(f["family"], f["law"]) for f in data["fits"]} == {
        (f, law) for f in fams for law in ("L(N)", "L(C)")
    }
    gaps = data["gaps"]
    assert gaps["reference"] == "gpn+m" and data["protocol"]["reference"] == "gpn+m"
    assert gaps["points"]["L(N)"] == [
        {"where": "largest in sweep", "at": {"N": top}},
        {"where": "target", "at": {"N": 1e7}},
    ]
    got = {(g["family"], g["measure"], g["where"]): g for g in gaps["gaps"]}
    assert set(got) == {
        (f, m, w)
        for f in fams - {"gpn+m"}
        for m in ("loss_ratio_N", "loss_ratio_C", "compute_multiplier")
        for w in ("largest in sweep", "target")
    }
    for fam in fams - {"gpn+m"}:
        g = got[(fam, "loss_ratio_N", "largest in sweep")]
        want = law(fam, top) / law("gpn+m", top)
        assert g["value"] == pytest.approx(want, rel=5e-3), fam
        assert g["ci_low"] <= g["value"] <= g["ci_high"], (fam, g)  # coverage: test_gaps.py
        assert got[(fam, "loss_ratio_N", "target")]["extrapolated"]
    # worse than gpn+m (gpn) needs more compute, better (gpn+m-2l, transformer++) less
    mult = {
        f: got[(f, "compute_multiplier", "largest in sweep")]["value"] for f in fams - {"gpn+m"}
    }
    assert mult["gpn"] > 1 > max(mult["gpn+m-2l"], mult["transformer++"])

    report = (out / "report.md").read_text()
    assert "## Gaps against gpn+m" in report
    for fam in fams - {"gpn+m"}:
        assert f"| {fam} | loss ratio at equal N | N=" in report
        assert f"| {fam} | compute multiplier" in report
    blob = (out / "loss_vs_C.png").read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and "](loss_vs_C.png)" in report
    assert "gpn+m-2l vs gpn+m: loss ratio at equal N" in printed.out

    # another reference; scanning the run roots (labels from config.yaml) finds the same runs
    rc = main(
        ["fit", str(tmp_path / "ckpt"), "--out", str(tmp_path / "fit2"), "--laws", "L(N)"]
        + ["--reference", "gpn", "--resamples", "1000"]
    )
    assert rc == 0, capsys.readouterr().err
    data2 = json.loads((tmp_path / "fit2" / "fit.json").read_text())
    assert {c["family"] for c in data2["cells"]} == {"gpn+m", "gpn+m-2l", "gpn"}
    assert data2["gaps"]["reference"] == "gpn"
    assert {g["family"] for g in data2["gaps"]["gaps"]} == {"gpn+m", "gpn+m-2l"}


def test_unknown_reference_is_a_one_line_error(sweep_path, tmp_path, capsys):
    finish_runs(sweep_path)
    rc = main(
        ["fit", "--sweep", str(sweep_path), "--out", str(tmp_path / "f"), "--laws", "L(N)"]
        + ["--reference", "gdn"]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert "--reference: family 'gdn' has no runs; known: gpn, gpn+m, gpn+m-2l" in err
    assert not (tmp_path / "f").exists()


def test_report_sets_the_papers_130m_figures_beside_the_sweeps(sweep_path, tmp_path, capsys):
    """The fit report's "The paper at 130M": every family's published FineWeb-Edu PPL and
    LAMBADA (the model spec's table) beside the sweep's cell at the paper's N, with t-intervals
    over the seeds; LAMBADA from the `eval --task lambada` JSON beside a run's final step, or
    from a table's columns."""
    from scipy import stats

    from gpn_scale.scaling.paper import PAPER_TOKENS, paper_params

    runs = finish_runs(sweep_path)
    n_gpn = paper_params("gpn_m_130m")
    assert n_gpn == 129_151_902  # counted from configs/model/gpn_m_130m.yaml
    rng = np.random.default_rng(2)
    losses, accs, lppls = [], [0.141, 0.152, 0.147], [35.1, 33.0, 34.2]
    root = tmp_path / "runs130"
    for seed in range(3):  # three finished runs of the paper's 1-layer GPN+M, LAMBADA-scored
        run = root / f"gpn_m_130m-s{seed}"
        ck = run / "checkpoints"
        ck.mkdir(parents=True)
        loss = law("gpn+m", n_gpn) * float(np.exp(rng.normal(0, 0.01)))
        losses.append(loss)
        (run / "config.yaml").write_text(
            f"model: gpn_m_130m\nseed: {seed}\ndata:\n  seq_len: 2048\n"
        )
        step = ck / "step_000010000"
        done = {"step": 10000, "tokens": PAPER_TOKENS, "final_eval_loss": loss, "params": n_gpn}
        done |= {"flops": 6.0 * n_gpn * PAPER_TOKENS, "checkpoint": str(step)}
        (ck / "DONE").write_text(json.dumps(done))
        result = {"task": "lambada", "metrics": {"accuracy": accs[seed], "ppl": lppls[seed]}}
        (ck / "step_000010000.lambada.json").write_text(json.dumps(result))
    n_tpp = paper_params("transformer_pp_130m")
    table = tmp_path / "tpp.csv"  # Transformer++ trained elsewhere, LAMBADA at 130M only
    rows = ["family,N,D,loss,seed,lambada_acc,lambada_ppl"]
    for n in sorted({r.params for r in runs if r.family == "gpn+m"}) + [n_tpp]:
        for s in range(3):
            lam = f"{0.22 + 0.001 * s},{19.0 + s}" if n == n_tpp else ","
            rows.append(f"transformer_pp,{n},{2 * n},{law('transformer++', n):.6f},{s},{lam}")
    table.write_text("\n".join(rows) + "\n")

    out = tmp_path / "fit"
    argv = ["fit", "--sweep", str(sweep_path), str(root), "--table", str(table)]
    assert main([*argv, "--out", str(out), "--laws", "L(N)"]) == 0, capsys.readouterr().err
    report = (out / "report.md").read_text()
    assert "## The paper at 130M" in report and "gpn-model.md" in report

    def t_ci(xs, log=False):
        xs = np.log(xs) if log else np.asarray(xs)
        half = stats.t.ppf(0.975, len(xs) - 1) * xs.std(ddof=1) / np.sqrt(len(xs))
        return xs.mean(), xs.mean() - half, xs.mean() + half

    m, lo, hi = t_ci(losses)
    a, alo, ahi = t_ci(accs)
    p, plo, phi = t_ci(lppls, log=True)
    row = next(line for line in report.splitlines() if line.startswith("| gpn+m | gpn_m_130m"))
    assert row == (
        f"| gpn+m | gpn_m_130m (129.2M) | 18.06 | 0.146 | 33.45 | 129.2M (+0.0%), 2.62e+09, 3 | "
        f"{np.exp(m):.2f} [{np.exp(lo):.2f}, {np.exp(hi):.2f}] | {a:.3f} [{alo:.3f}, {ahi:.3f}] "
        f"| {np.exp(p):.2f} [{np.exp(plo):.2f}, {np.exp(phi):.2f}] |"
    )
    tpp = next(ln for ln in report.splitlines() if ln.startswith("| transformer_pp | transf"))
    assert "| 16.05 | 0.223 | 18.99 | 134.1M (+0.0%)" in tpp and "| 0.221 [" in tpp
    for fam, ppl in (("gated_deltanet", "15.34"), ("gpn+m-2l", "16.95"), ("gpn", "23.51")):
        line = next(ln for ln in report.splitlines() if ln.startswith(f"| {fam} | {fam[:3]}"))
        assert f"| {ppl} |" in line and "no run within ±15% of N | — | — | — |" in line, line

    data = json.loads((out / "fit.json").read_text())["paper_130m"]
    assert "gpn-model.md" in data["source"]
    got = {e["family"]: e for e in data["families"]}
    assert set(got) == {"transformer_pp", "gated_deltanet", "gpn+m", "gpn+m-2l", "gpn"}
    assert got["gated_deltanet"]["paper"]["N"] == 143_758_456  # the paper's shape, counted
    sweep = got["gpn+m"]["sweep"]
    assert sweep["seeds"] == 3 and sweep["heldout_ppl"] == pytest.approx(np.exp(m))
    assert sweep["lambada_acc_ci"] == pytest.approx([alo, ahi])
    assert got["gpn"]["sweep"] is None
