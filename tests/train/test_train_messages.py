"""Bad input fails in one line that names the setting the user wrote (issue 13, item 6):
`model_overrides.<key>`, `run_dir`, `data.seq_len`, eval's own `--checkpoint`; a dataset too
small for one batch is a data error (exit 2) like the others."""

from __future__ import annotations

import pytest
from train_helpers import train_args

from gpn_scale.cli import main


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("gpn-scale: error:")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize(
    "override,expected",
    [
        (
            "model_overrides.d_stat=64",
            "model_overrides.d_stat: unknown key (did you mean 'd_state'?)",
        ),
        ("model_overrides.d_state=abc", "model_overrides.d_state: expected an integer, got 'abc'"),
        ("model_overrides.n_heads=0", "model_overrides.n_heads: must be >= 1, got 0"),
    ],
)
def test_model_override_errors_name_their_key(corpus, tmp_path, capsys, override, expected):
    assert main(train_args(corpus, tmp_path / "run", override)) == 2
    assert expected in _error(capsys)


def test_unwritable_run_dir_names_run_dir(corpus, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("in the way")
    assert main(train_args(corpus, blocker / "run")) == 2
    line = _error(capsys)
    assert f"run_dir {blocker / 'run'}" in line and "choose another run_dir" in line
    assert "checkpoint" not in line


def test_seq_len_mismatch_names_data_seq_len(corpus, tmp_path, capsys):
    assert main(train_args(corpus, tmp_path / "run") + ["data.seq_len=32"]) == 2
    line = _error(capsys)
    assert "data.seq_len=32 does not match" in line and "set data.seq_len=64" in line


@pytest.mark.parametrize(
    "override,key",
    [
        ("train.global_batch_size=100000", "lower train.global_batch_size"),
        ("eval.batch_size=5000", "lower eval.batch_size"),
    ],
)
def test_too_small_dataset_exits_2(corpus, tmp_path, capsys, override, key):
    assert main(train_args(corpus, tmp_path / "run", override)) == 2
    line = _error(capsys)
    assert "windows, fewer than one batch needs" in line and key in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_eval_hints_name_eval_flags(corpus, tmp_path, capsys):
    args = train_args(corpus, tmp_path / "run")
    args[0] = "eval"
    assert main(args + ["--checkpoint", str(tmp_path / "not_a_step")]) == 2
    line = _error(capsys)
    assert "--checkpoint auto" in line and "--resume" not in line
