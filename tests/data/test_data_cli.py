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
