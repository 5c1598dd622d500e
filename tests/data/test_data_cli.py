"""`gpn-data …` and `gpn-scale data …` are the same commands, each with --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from data_tools.cli import build_parser

SUBCOMMANDS = ["build", "tokenize", "train-tokenizer", "inspect", "verify", "default-corpus"]


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_every_subcommand_has_help_in_both_clis(sub, capsys):
    from gpn_scale.cli import build_parser as gpn_scale_parser

    for parser, prefix in ((build_parser(), []), (gpn_scale_parser(), ["data"])):
        with pytest.raises(SystemExit) as done:
            parser.parse_args([*prefix, sub, "--help"])
        assert done.value.code == 0
        assert "usage:" in capsys.readouterr().out


def test_same_command_functions_behind_both_clis():
    from gpn_scale.cli import build_parser as gpn_scale_parser

    a = build_parser().parse_args(["verify", "x"])
    b = gpn_scale_parser().parse_args(["data", "verify", "x"])
    assert a.func is b.func


def test_gpn_scale_reports_data_errors_as_one_line(tmp_path):
    missing = tmp_path / "nothing"
    proc = subprocess.run(
        [sys.executable, "-m", "gpn_scale", "data", "inspect", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("gpn-scale: error:")
    assert f"dataset directory {missing} is missing" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    missing.mkdir()  # a directory, but no dataset in it
    proc = subprocess.run(
        [sys.executable, "-m", "gpn_scale", "data", "inspect", str(missing)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no dataset metadata" in proc.stderr and proc.stderr.strip().count("\n") == 0


def test_build_refuses_an_unwritable_or_wrong_out_before_reading(tmp_path, capsys):
    """An existing file or a read-only place as --out: one line naming --out, exit 2, before
    the inputs are read (the input here does not even exist as a corpus)."""
    from data_tools.cli import main as gpn_data

    text = tmp_path / "doc.txt"
    text.write_text("hello world " * 50)
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    for out, words in (
        (a_file, "exists and is a file, not a directory"),
        ("/proc/sys/gpn_data_out", "not writable"),  # a read-only place, also for root
        ("/proc/gpn_data_out", "refuses new entries"),
    ):
        assert gpn_data(["build", str(text), "--seq-len", "16", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"--out {out}: " in err and words in err, err
        assert "choose another --out" in err
    assert a_file.read_text() == "keep me"


def test_no_progress_bars_into_a_pipe(tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("hello world " * 200)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_tools",
            "build",
            str(text),
            "--seq-len",
            "16",
            "--out",
            str(tmp_path / "out"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "tokenise" not in proc.stderr and "%|" not in proc.stderr
    assert proc.stdout.startswith("wrote ")
