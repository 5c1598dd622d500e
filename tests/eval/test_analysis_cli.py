"""`gpn-scale analyze` end to end on a tiny checkpoint (saved through the CheckpointManager as
the trainer does) and the embedded byte-level corpus: the three outputs, and one-line
refusals (exit 2, nothing written) of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpn_scale.cli import main

SEQ_LEN = 64


@pytest.fixture(scope="module")
def corpus(default_corpus: str) -> str:
    return default_corpus  # the session's one build, at seq_len 64 = SEQ_LEN


def save_checkpoint(root: Path, model_name: str = "tiny") -> str:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from gpn_scale.checkpoint import CheckpointManager
    from gpn_scale.models.registry import load_model_config

    spec, cfg = load_model_config(model_name)
    torch.manual_seed(0)
    model = spec.build(cfg)
    meta = {"step": 3, "tokens": 0, "model_config": cfg.to_dict(), "config": {}}
    return CheckpointManager(str(root)).save(3, {"model": get_model_state_dict(model)}, meta=meta)


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["analyze", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_analyze_writes_report_json_and_plots(corpus, tmp_path, private_tmpdir, capsys):
    ckpt = save_checkpoint(tmp_path / "ckpts")
    out = tmp_path / "analysis"
    code, stdout, _ = run(
        capsys, ckpt, "--data", corpus, "--out", str(out), "--windows", "6",
        "--batch-size", "4", "--max-lag", "8", "--unigram-tokens", "5000",
    )  # fmt: skip
    assert code == 0, stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "analysis.json", "memory_retention.png", "report.md", "spectrum.png", "state_horizon.png",
    ]  # fmt: skip
    result = json.loads((out / "analysis.json").read_text())
    assert result["windows"] == 6 and result["window_tokens"] == SEQ_LEN
    assert result["source"]["checkpoint"] == ckpt and result["source"]["step"] == 3
    assert len(result["memory_horizon"]["heads"]) == 2
    assert len(result["state_horizon"]["raw"]) == 8
    assert result["mean_direction"]["unigram_tokens"] == 5000
    assert len(result["mean_direction"]["top_tokens"]) == 10
    assert result["peak_memory"]["rss_mib"] > 0 and result["accumulator_bytes"] > 0
    report = (out / "report.md").read_text()
    for heading in ("State geometry", "Mean direction", "State horizon", "Memory horizon"):
        assert heading in report
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "stable rank" in stdout and "memory: " in stdout

    # A second run into the same directory is refused; with --overwrite it goes ahead.
    before = (out / "report.md").stat().st_mtime_ns
    code, _, err = run(capsys, ckpt, "--data", corpus, "--out", str(out), "--windows", "2")
    assert code == 2 and err.count("\n") == 1 and "--overwrite" in err
    assert (out / "report.md").stat().st_mtime_ns == before


def test_gpn_without_memory_reports_the_skip(corpus, tmp_path, private_tmpdir, capsys):
    ckpt = save_checkpoint(tmp_path / "ckpts", "tiny_gpn")
    out = tmp_path / "analysis"
    args = ("--data", corpus, "--out", str(out), "--windows", "2", "--batch-size", "2")
    code, stdout, _ = run(capsys, ckpt, *args, "--max-lag", "4", "--unigram-tokens", "0")
    assert code == 0 and "memory horizon skipped" in stdout
    assert "GPN without memory" in (out / "report.md").read_text()


@pytest.mark.parametrize(
    "case",
    ["windows", "missing_checkpoint", "non_gpn", "empty_root", "out_is_file", "no_data"],
)
def test_bad_input_is_one_line_and_writes_nothing(case, corpus, tmp_path, private_tmpdir, capsys):
    out = tmp_path / "analysis"
    data = ["--data", corpus]
    if case == "windows":
        args = [save_checkpoint(tmp_path / "c"), *data, "--windows", "0"]
        want = "--windows 0"
    elif case == "missing_checkpoint":
        args = [str(tmp_path / "nowhere"), *data]
        want = "no such file"
    elif case == "non_gpn":
        args = [save_checkpoint(tmp_path / "c", "transformer_pp_tiny"), *data]
        want = "transformer_pp checkpoint"
    elif case == "empty_root":
        (tmp_path / "empty").mkdir()
        args = [str(tmp_path / "empty"), *data]
        want = "no complete checkpoint"
    elif case == "out_is_file":
        out.write_text("x")
        args = [save_checkpoint(tmp_path / "c"), *data]
        want = "is a file"
    else:  # the manifest's config names no dataset
        args = [save_checkpoint(tmp_path / "c")]
        want = "pass --data"
    code, _, err = run(capsys, *args, "--out", str(out))
    assert code == 2
    assert err.startswith("gpn-scale: error: ") and err.count("\n") == 1, err
    assert want in err
    assert not out.is_dir()


def test_an_unwritable_out_is_one_line_before_any_analysis(corpus, tmp_path, capsys):
    """A read-only place or one that refuses new entries as --out: one line naming --out,
    exit 2, before the checkpoint is even loaded (it does not exist here)."""
    for out, words in (
        ("/proc/sys/gpn_analysis_out", "not writable"),  # read-only, also for root
        ("/proc/gpn_analysis_out", "refuses new entries"),
    ):
        code, _, err = run(capsys, str(tmp_path / "no_checkpoint"), "--data", corpus, "--out", out)
        assert code == 2 and err.strip().count("\n") == 0, err
        assert f"--out {out}: " in err and words in err, err
