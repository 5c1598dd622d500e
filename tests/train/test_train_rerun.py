"""Nothing a run wrote is lost silently: re-running `gpn-scale train` into a run directory
(no --resume: the default is auto) leaves a finished run as it is, starting fresh over
checkpoints is the explicit --fresh, and a failed start (exit 2) leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import read_metrics, train_args

from gpn_scale.cli import main

pytestmark = pytest.mark.slow

ARGS = ("schedule.total_steps=2", "schedule.warmup_steps=1", "checkpoint.every_steps=1")


def _files(run_dir: Path) -> dict[str, bytes]:
    """Every file a run wrote (not the streaming cache, which is scratch)."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.relative_to(run_dir).parts[0] != "data"
    }


def _train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if "train/loss" in r]


def _error_lines(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_rerun_of_a_finished_run_changes_nothing(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(train_args(corpus, run_dir, *ARGS)) == 0
    before = _files(run_dir)
    assert _train_steps(run_dir) == [1, 2] and "checkpoints/DONE" in before
    capsys.readouterr()
    assert main(train_args(corpus, run_dir, *ARGS)) == 0  # the same command again
    assert "run already finished at step 2" in capsys.readouterr().out
    assert _files(run_dir) == before  # no retraining, same checkpoints, DONE, history


def test_fresh_start_over_checkpoints_is_an_explicit_choice(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(train_args(corpus, run_dir, *ARGS)) == 0
    before = _files(run_dir)
    capsys.readouterr()
    assert main(train_args(corpus, run_dir, *ARGS) + ["--resume", "none"]) == 2
    err = _error_lines(capsys)
    assert len(err) == 1 and "already holds checkpoints (newest step 2)" in err[0], err
    assert "--fresh" in err[0]
    assert _files(run_dir) == before
    # --fresh whose setup fails (no such dataset) deletes nothing either.
    bad = train_args(str(tmp_path / "no_dataset"), run_dir, *ARGS) + ["--fresh"]
    assert main(bad) == 2
    assert _files(run_dir) == before
    capsys.readouterr()
    assert main(train_args(corpus, run_dir, *ARGS) + ["--fresh"]) == 0
    assert "--fresh: deleted 2 checkpoint(s)" in capsys.readouterr().out
    assert _train_steps(run_dir) == [1, 2]  # one history, not two
    assert json.loads((run_dir / "checkpoints" / "DONE").read_text())["step"] == 2


def test_failed_start_leaves_nothing_behind(corpus, tmp_path):
    missing = str(tmp_path / "no_dataset")
    new_parent = tmp_path / "new"
    assert main(train_args(missing, new_parent / "run", *ARGS)) == 2
    assert not new_parent.exists()
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert main(train_args(missing, empty, *ARGS)) == 2
    assert list(empty.iterdir()) == []  # no checkpoints/.staging, no data/
