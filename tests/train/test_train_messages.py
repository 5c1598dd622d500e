"""Bad input fails in one line that names the setting the user wrote (issue 13, item 6):
`model_overrides.<key>`, `run_dir`, `data.seq_len`, eval's own `--checkpoint`; a dataset too
small for one batch is a data error (exit 2) like the others."""

from __future__ import annotations

import shutil
from pathlib import Path

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
        ("model_overrides.norm_eps=.inf", "model_overrides.norm_eps: must be a finite number"),
        ("model_overrides.norm_eps=nan", "model_overrides.norm_eps: expected a number, got 'nan'"),
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


def test_gdn_backend_that_cannot_run_is_refused_before_the_run_folder(
    corpus, tmp_path, capsys, monkeypatch
):
    """fla's kernels forced on a CPU, or a bogus GPN_SCALE_GDN_BACKEND: refused with the
    other checks (it used to pass them and die at step 1 in a 57-line traceback, leaving the
    run folder behind)."""
    run = tmp_path / "run"
    gdn = ["model=gated_deltanet_tiny"]
    assert main(train_args(corpus, run, *gdn, "model_overrides.backend=fla")) == 2
    line = _error(capsys)
    assert line.startswith("gpn-scale: error: model_overrides.backend='fla': gated delta rule")
    assert "serves CUDA tensors, not cpu" in line and "use auto, chunk or recurrent" in line
    assert not run.exists()
    monkeypatch.setenv("GPN_SCALE_GDN_BACKEND", "bogus")
    assert main(train_args(corpus, run, *gdn)) == 2
    assert "GPN_SCALE_GDN_BACKEND='bogus': expected one of auto, chunk, recurrent, fla" in (
        _error(capsys)
    )
    assert not run.exists()
    assert main([*train_args(corpus, run, *gdn), "--dry-run"]) == 2  # the dry run checks it too
    assert "GPN_SCALE_GDN_BACKEND='bogus'" in _error(capsys)


def test_run_dir_in_proc_names_run_dir(corpus, capsys):
    """run_dir=/proc/x: root passes every permission check there, and the checkpoint root
    under it used to take the blame."""
    assert main(train_args(corpus, Path("/proc/gpn_scale_run"))) == 2
    line = _error(capsys)
    assert line.startswith("gpn-scale: error: run_dir /proc/gpn_scale_run: /proc refuses new")
    assert "choose another run_dir" in line and "checkpoint" not in line


def test_bad_data_at_the_first_batch_leaves_no_run_folder(corpus, tmp_path, capsys):
    """A data error met by the first batch (every train shard corrupt) is exit 2 with one
    line, and the run folder it had just made is gone again (nothing was trained)."""
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    for shard in (data / "train").glob("shard.*"):
        raw = bytearray(shard.read_bytes())
        raw[40:80] = bytes(40)
        shard.write_bytes(bytes(raw))
    run = tmp_path / "new" / "run"
    assert main(train_args(str(data), run, "checkpoint.every_steps=0")) == 2
    assert "hash does not match" in _error(capsys)
    assert not (tmp_path / "new").exists()
    existing = tmp_path / "existing"  # a run dir that was there: kept, only our files go
    (existing / "notes.txt").parent.mkdir()
    (existing / "notes.txt").write_text("mine")
    assert main(train_args(str(data), existing, "checkpoint.every_steps=0")) == 2
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]


def test_demo_steps_zero_is_refused(tmp_path, capsys):
    """--steps 0 used to mean "not given" and run the whole demo."""
    assert main(["demo", "--steps", "0", "--out", str(tmp_path / "demo")]) == 2
    line = _error(capsys)
    assert "--steps 0: the demo trains at least 1 step; omit --steps for the demo's" in line
    assert not (tmp_path / "demo").exists()


def test_dry_run_on_a_finished_run_says_it_is_finished(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    steps = ["schedule.total_steps=1", "schedule.warmup_steps=0", "checkpoint.every_steps=0"]
    assert main(train_args(corpus, run, *steps)) == 0
    capsys.readouterr()
    assert main([*train_args(corpus, run, *steps), "--dry-run"]) == 0
    out = capsys.readouterr().out
    resume = next(line for line in out.splitlines() if line.startswith("resume: "))
    assert resume.startswith("resume: auto: the run already finished at step 1 (")
    assert "a start would do nothing" in resume and "->" not in resume
    assert main([*train_args(corpus, run, *steps[1:], "schedule.total_steps=2"), "--dry-run"]) == 0
    resume = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("resume: "))
    assert resume.startswith("resume: auto -> ") and "step_000000001" in resume


def test_help_config_lists_every_key_without_reading_a_config(capsys):
    """Generated from the schema: every key, its type, default and the meaning written
    beside it in gpn_scale/run/config_schema.py; no config is read, no check is run."""
    from gpn_scale.run.config import all_keys, config_help

    with pytest.raises(SystemExit) as done:
        main(["train", "no_such_config", "optim.lr=nan", "--help-config"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    listed = [line.split(":")[0].strip() for line in out.splitlines() if line.startswith("  ")]
    listed = [k for k in listed if k and not k.startswith("[")]
    assert set(all_keys()) <= set(listed)
    rows = {key: (kind, default, meaning) for key, kind, default, meaning in config_help()}
    assert sorted(rows) == sorted(all_keys())
    assert [k for k, (_, _, meaning) in rows.items() if not meaning] == []  # each says why
    assert rows["optim.lr"][:2] == ("float", "0.0006") and "learning rate" in rows["optim.lr"][2]
    assert "  checkpoint.every_steps: int = 0\n      0 = only on preemption and at the end" in out
    assert "analysis.rows" in rows  # a section the key checks used to skip
