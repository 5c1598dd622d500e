"""Collecting runs (local dirs, S3, tables, W&B) and `gpn-scale fit` end to end."""

from __future__ import annotations

import csv
import json
import textwrap

import numpy as np
import pytest

from gpn_scale.cli import main
from gpn_scale.models.gpn.config import GPNConfig
from gpn_scale.scaling import collect as C
from gpn_scale.scaling.sweep import load_sweep

LAW = {"E": 2.0, "A": 40.0, "alpha": 0.25}
SIZES = [
    GPNConfig(vocab_size=256, d_state=d, d_emb=16, d_ffn=2 * d, n_heads=2, d_key=8, d_value=8)
    for d in (32, 64, 128, 256)
]


def law(n):
    return LAW["E"] + LAW["A"] * n ** -LAW["alpha"]


@pytest.fixture
def sweep_path(tmp_path):
    (tmp_path / "models").mkdir()
    entries = []
    for i, cfg in enumerate(SIZES):
        fields = {
            k: v
            for k, v in cfg.to_dict().items()
            if k not in ("name", "norm_eps") and v is not None
        }
        (tmp_path / "models" / f"m{i}.yaml").write_text(
            "\n".join(f"{k}: {json.dumps(v)}" for k, v in fields.items())
        )
        entries.append(f"  - {{config: models/m{i}.yaml}}")
    path = tmp_path / "sweep.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        name: fx
        seeds: [0, 1, 2]
        data: {{remote: s3://bkt/mds, seq_len: 16}}
        checkpoint_root: {tmp_path / "ckpt"}
        run_root: {tmp_path / "runs"}
        wandb: {{project: p}}
        defaults: {{tokens_per_param: 2, global_batch_size: 2, lr: 1.0e-3, warmup_steps: 1}}
        models:
        """)
        + "\n".join(entries)
        + "\n"
    )
    return path


def finish_runs(sweep_path, noise=0.003, skip=(), default_layout=False):
    """Write what finished training runs leave: DONE in the checkpoint root (with
    default_layout, where the trainer puts it without checkpoint.root: <run_dir>/checkpoints),
    metrics.jsonl and config.yaml in the run dir; losses follow LAW with seed noise."""
    rng = np.random.default_rng(0)
    runs = load_sweep(sweep_path).runs
    for r in runs:
        loss = law(r.params) * float(np.exp(rng.normal(0, noise)))
        run_dir = __import__("pathlib").Path(r.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "metrics.jsonl", "w") as f:
            f.write(json.dumps({"step": 1, "train/loss": 9.0}) + "\n")
            f.write(
                json.dumps(
                    {"step": r.total_steps // 2, "tokens": r.tokens // 2, "eval/loss": loss + 0.5}
                )
                + "\n"
            )
            f.write(
                json.dumps({"step": r.total_steps, "tokens": r.tokens, "eval/loss": loss}) + "\n"
            )
        (run_dir / "config.yaml").write_text(f"model: {r.model}\nseed: {r.seed}\n")
        if r.name in skip:
            continue
        ck = (
            run_dir / "checkpoints"
            if default_layout
            else __import__("pathlib").Path(r.checkpoint_root)
        )
        ck.mkdir(parents=True, exist_ok=True)
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


def baseline_table(path, family="transformer++", e=1.9, a=30.0, alpha=0.3):
    rng = np.random.default_rng(1)
    with open(path, "w", newline="") as f:
        f.write("# external baseline results\n")
        w = csv.writer(f)
        w.writerow(["family", "N", "D", "loss", "seed"])
        for n in (1e4, 3e4, 1e5, 3e5):
            for s in range(3):
                w.writerow(
                    [family, n, 20 * n, (e + a * n**-alpha) * np.exp(rng.normal(0, 0.003)), s]
                )
    return path


@pytest.mark.slow
def test_fit_command_end_to_end_with_a_baseline_table(sweep_path, tmp_path, capsys):
    finish_runs(sweep_path)
    out = tmp_path / "fit"
    table = baseline_table(tmp_path / "baselines.csv")
    rc = main(
        [
            "fit",
            "--sweep",
            str(sweep_path),
            "--table",
            str(table),
            "--out",
            str(out),
            "--laws",
            "L(N)",
            "L(C)",
            "L(N,D)",
        ]
    )
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    data = json.loads((out / "fit.json").read_text())
    laws = {(f["family"], f["law"]) for f in data["fits"]}
    assert laws == {
        ("gpn+m", "L(N)"),
        ("gpn+m", "L(C)"),
        ("transformer++", "L(N)"),
        ("transformer++", "L(C)"),
    }
    gpn = next(f for f in data["fits"] if f["family"] == "gpn+m" and f["law"] == "L(N)")
    for k, v in LAW.items():
        p = gpn["params"][k]
        assert p["ci_low"] <= v <= p["ci_high"], (k, p)
    assert gpn["bootstrap"]["resamples"] == 1000 and gpn["n_points"] == 4
    assert all(c["n"] == 3 for c in data["cells"]) and len(data["cells"]) == 8
    assert any("L(N,D) skipped" in n for n in data["notes"])
    report = (out / "report.md").read_text()
    assert "## L(N) = E + A·N^-alpha" in report and "| transformer++ | 4 |" in report
    for png in ("loss_vs_N.png", "loss_vs_C.png", "residuals.png"):
        blob = (out / png).read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 10_000
        assert f"]({png})" in report
    assert "wrote" in printed.out and "gpn+m" in printed.out


def test_collector_falls_back_to_metrics_and_reports_unfinished_runs(sweep_path, tmp_path, capsys):
    runs = finish_runs(sweep_path, skip={"fx-m0-s0"})
    # a finished run whose marker lacks the loss: the last eval/loss of metrics.jsonl is used
    done = __import__("pathlib").Path(runs[1].checkpoint_root) / "DONE"
    d = json.loads(done.read_text())
    d["final_eval_loss"] = None
    done.write_text(json.dumps(d))
    # an unfinished run: no marker, last eval at half the planned tokens
    lines = (__import__("pathlib").Path(runs[0].run_dir) / "metrics.jsonl").read_text().splitlines()
    (__import__("pathlib").Path(runs[0].run_dir) / "metrics.jsonl").write_text(
        "\n".join(lines[:2]) + "\n{torn"
    )
    col = C.collect_sweep(load_sweep(sweep_path))
    status = {r.name: r.status for r in col.records}
    assert status["fx-m0-s0"] == "missing" and status["fx-m0-s1"] == "metrics"
    assert sum(s == "done" for s in status.values()) == 10
    miss = col.missing[0]
    assert (
        miss.detail == f"unfinished: no DONE marker; last eval at {runs[0].tokens // 2} "
        f"tokens of {runs[0].tokens}"
    )
    rec = next(r for r in col.records if r.name == "fx-m0-s1")
    last = (
        (__import__("pathlib").Path(runs[1].run_dir) / "metrics.jsonl").read_text().splitlines()[-1]
    )
    assert rec.loss == json.loads(last)["eval/loss"] and rec.D == runs[1].tokens

    out = tmp_path / "fit"
    assert main(["fit", "--sweep", str(sweep_path), "--out", str(out), "--laws", "L(N)"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(
            "gpn-scale: error: 1 of 12 runs have no final loss (first: fx-m0-s0: unfinished"
        )
        and err.endswith("pass --allow-missing")
        and "\n" not in err
    )
    # the marker is the authority: a run with no marker that did reach its budget counts
    col2 = C.collect_sweep(load_sweep(sweep_path), allow_unfinished=True)
    assert {r.name: r.status for r in col2.records}["fx-m0-s0"] == "metrics"


def test_fit_with_too_few_sizes_is_a_one_line_cli_error(sweep_path, tmp_path, capsys):
    finish_runs(sweep_path)
    assert (
        main(["fit", str(tmp_path / "ckpt"), "--out", str(tmp_path / "f"), "--families", "nope"])
        == 2
    )
    assert "family 'nope' has no runs" in capsys.readouterr().err
    # keep only two sizes' runs
    import shutil

    for d in (tmp_path / "ckpt").iterdir():
        if "-m2-" in d.name or "-m3-" in d.name:
            shutil.rmtree(d)
    assert main(["fit", str(tmp_path / "ckpt"), "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(
            "gpn-scale: error: none of the laws can be fitted: L(N) fit for "
            "family 'gpn+m' has 2 distinct sizes but 3 parameters; add sizes/"
            "token budgets to the sweep or drop this family or law from the fit; "
            "L(C) fit"
        )
        and "\n" not in err
    )
    assert (
        main(["fit", str(tmp_path / "ckpt"), "--out", str(tmp_path / "f"), "--laws", "L(N)"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == (
        "gpn-scale: error: L(N) fit for family 'gpn+m' has 2 distinct sizes but 3 "
        "parameters; add sizes/token budgets to the sweep or drop this family or law "
        "from the fit"
    )


def test_fit_with_fewer_starts_records_them_and_refuses_none(sweep_path, tmp_path, capsys):
    """--max-starts K: L-BFGS from the K best grid points only (a smoke test's quick fit),
    recorded in fit.json; fewer than one start is one line, exit 2, nothing written."""
    finish_runs(sweep_path)
    ckpt, out = str(tmp_path / "ckpt"), tmp_path / "fit"
    assert main(["fit", ckpt, "--out", str(out), "--laws", "L(N)", "--max-starts", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "gpn-scale: error: --max-starts: at least 1 start, got 0"
    assert not out.exists()
    assert main(["fit", ckpt, "--out", str(out), "--laws", "L(N)", "--max-starts", "4"]) == 0
    data = json.loads((out / "fit.json").read_text())
    assert data["protocol"]["max_starts"] == 4
    assert [(f["law"], f["optimizer"]["starts"]) for f in data["fits"]] == [("L(N)", 4)]
    report = (out / "report.md").read_text()
    assert "only the 4 with the lowest initial loss: --max-starts" in report


def test_fit_with_one_token_budget_skips_l_n_d_and_writes_the_rest(sweep_path, tmp_path, capsys):
    """The sweep gives every size the same `tokens:`; the default laws include L(N,D),
    which that cannot identify: it is skipped with a note, L(N) and L(C) are written. With
    three sizes left, L(N) has as many points as parameters: no interval is printed."""
    text = sweep_path.read_text().replace("tokens_per_param: 2", "tokens: 4096")
    sweep_path.write_text(text)
    finish_runs(sweep_path)
    out = tmp_path / "fit"
    assert main(["fit", "--sweep", str(sweep_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "note: gpn+m: L(N,D) skipped: it has one token budget D for all runs" in printed
    data = json.loads((out / "fit.json").read_text())
    assert {f["law"] for f in data["fits"]} == {"L(N)", "L(C)"}
    assert all(not f["interpolates"] for f in data["fits"])
    assert "L(N,D) skipped" in (out / "report.md").read_text()

    import shutil

    for d in (tmp_path / "ckpt").iterdir():
        if "-m3-" in d.name:
            shutil.rmtree(d)
    # an earlier fit in --out is never replaced silently: refused in one line, kept whole
    argv = ["fit", str(tmp_path / "ckpt"), "--out", str(out), "--laws", "L(N)"]
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "loss_vs_C.png" in before
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--out {out} already holds a fit (fit.json, report.md" in err
    assert err.endswith("pass --overwrite to replace it or choose another --out")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main([*argv, "--overwrite"]) == 0
    assert not (out / "loss_vs_C.png").exists()  # the old fit's plot went with it
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "L(N)" in ln)
    assert "3 points = parameters: interpolates, no interval" in line and "[" not in line
    report = (out / "report.md").read_text()
    assert "| gpn+m | 3 (interpolates) |" in report and "interval is reported" in report


def test_fit_out_that_cannot_be_written_is_refused_before_collecting(tmp_path, capsys):
    """An existing file or an unwritable place as --out: one line, exit 2, before any run is
    read (the run root here does not exist: the --out check comes first)."""
    a_file = tmp_path / "a_file"
    a_file.write_text("keep")
    for out, words in ((a_file, "exists and is a file"), ("/proc/sys/gpn_fit", "not writable")):
        assert main(["fit", str(tmp_path / "no_runs"), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"--out {out}: " in err and words in err, err
    assert a_file.read_text() == "keep"


def test_collect_roots_reads_runs_from_s3(s3_bucket, s3_endpoint):
    client = s3_endpoint.client()
    bucket = s3_bucket[len("s3://") :]
    expected = {}
    for i, (model, seed) in enumerate([("tiny", 0), ("tiny", 1), ("tiny_gpn", 0)]):
        name = f"sw-{model}-s{seed}"
        loss = 3.0 + 0.1 * i
        client.put_object(
            Bucket=bucket,
            Key=f"sweep/{name}/DONE",
            Body=json.dumps(
                {
                    "step": 10,
                    "tokens": 1000 + i,
                    "final_eval_loss": loss,
                    "params": 5000 + i,
                    "flops": 3e10,
                }
            ).encode(),
        )
        client.put_object(
            Bucket=bucket,
            Key=f"sweep/{name}/config.yaml",
            Body=f"model: {model}\nseed: {seed}\n".encode(),
        )
        expected[name] = (("gpn" if model == "tiny_gpn" else "gpn+m"), seed, loss, 5000 + i)
    # a run still going: only metrics.jsonl, no marker -> reported missing, not fitted
    client.put_object(
        Bucket=bucket,
        Key="sweep/sw-late-s0/metrics.jsonl",
        Body=b'{"step": 3, "tokens": 30, "eval/loss": 5.0}\n',
    )
    col = C.collect_roots([f"{s3_bucket}/sweep"])
    got = {r.name: (r.family, r.seed, r.loss, r.N) for r in col.usable}
    assert got == expected
    assert [r.name for r in col.missing] == ["sw-late-s0"]
    assert col.missing[0].detail.startswith("unfinished: no DONE marker")


def test_read_table_defaults_and_errors(tmp_path):
    t = baseline_table(tmp_path / "b.csv")
    col = C.read_table(t)
    assert len(col.records) == 12 and {r.family for r in col.records} == {"transformer++"}
    r = col.records[0]
    assert r.C == pytest.approx(6 * r.N * r.D) and r.seed == 0
    bad = tmp_path / "bad.csv"
    bad.write_text("family,N,tokens,loss\nx,1,2,3\n")
    with pytest.raises(C.FitError, match=r"row 1: unknown column 'tokens'"):
        C.read_table(bad)
    bad.write_text("family,N,loss\nx,1,3\n")
    with pytest.raises(C.FitError, match=r"row 1: missing column D"):
        C.read_table(bad)
    js = tmp_path / "b.jsonl"
    js.write_text('{"family": "gdn", "N": 1e6, "D": 2e7, "C": 1e14, "loss": 3.1, "seed": 2}\n')
    (rec,) = C.read_table(js).records
    assert (rec.family, rec.C, rec.seed) == ("gdn", 1e14, 2)


def test_collect_wandb_reads_finished_runs_from_the_api():
    class Run:
        def __init__(self, name, state, summary, config):
            self.name, self.id, self.state, self.summary, self.config = (
                name,
                name,
                state,
                summary,
                config,
            )

    class Api:
        def runs(self, path, filters):
            assert path == "ent/proj" and filters == {"group": "g"}
            return [
                Run(
                    "a",
                    "finished",
                    {"eval/loss": 3.2, "params": 1e6, "tokens": 2e7, "flops": 1.2e14},
                    {"model": "tiny", "seed": 1},
                ),
                Run("b", "running", {}, {}),
            ]

    col = C.collect_wandb("ent/proj", group="g", api=Api())
    (a,) = col.usable
    assert (a.family, a.seed, a.loss, a.N) == ("gpn+m", 1, 3.2, 1e6)
    assert col.missing[0].detail == "W&B state running"


def test_fit_runs_reads_done_where_the_trainer_puts_it(sweep_path, tmp_path):
    """`fit RUNS...` on run dirs of the trainer's default layout (<run_dir>/checkpoints/DONE):
    the runs are finished, not 'unfinished: no DONE marker'; a run dir given alone too."""
    runs = finish_runs(sweep_path, default_layout=True)
    col = C.collect_roots([str(tmp_path / "runs")])
    assert len(col.records) == 12 and not col.missing, [r.detail for r in col.missing]
    assert all(r.status == "done" for r in col.records)
    one = C.collect_roots([runs[0].run_dir])
    assert [(r.name, r.status) for r in one.records] == [(runs[0].name, "done")]
