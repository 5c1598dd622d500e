"""No silent wrong result (issue 13 item 4): eval without a checkpoint fails instead of
scoring a random model, `eval --batches 0` is refused, `--resume auto` says which damaged
checkpoint it skipped and why, and a resume with a changed schedule / optimiser warns."""

from __future__ import annotations

import pytest
from train_helpers import SEQ_LEN, train_args, train_losses

from gpn_scale.cli import main


def _eval_args(corpus: str, run_dir, *extra: str) -> list[str]:
    return [
        "eval",
        "ci_tiny",
        f"data.remote={corpus}",
        f"data.seq_len={SEQ_LEN}",
        f"run_dir={run_dir}",
        *extra,
    ]


def _one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpn-scale: error: "), err
    return err[0]


def test_eval_auto_without_a_checkpoint_fails(corpus, tmp_path, capsys):
    run_dir = tmp_path / "never_trained"
    assert main(_eval_args(corpus, run_dir)) == 2
    line = _one_error(capsys)
    assert "no complete checkpoint" in line and "--checkpoint none" in line
    assert not run_dir.exists()  # and it wrote nothing
    # The untrained model is still there for whoever asks for it by name.
    assert main(_eval_args(corpus, run_dir, "--checkpoint", "none", "--batches", "1")) == 0
    assert "eval: loss" in capsys.readouterr().out


def test_eval_batches_zero_is_refused(corpus, tmp_path, capsys):
    assert main(_eval_args(corpus, tmp_path / "run", "--checkpoint", "none", "--batches", "0")) == 2
    assert "--batches 0: must be >= 1" in _one_error(capsys)


@pytest.mark.slow
def test_resume_auto_names_the_damaged_checkpoint_and_changed_settings(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    base = (
        "schedule.warmup_steps=1",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=3",
        "eval.at_end=false",
    )
    assert main(train_args(corpus, run_dir, "schedule.total_steps=4", *base)) == 0
    newest = run_dir / "checkpoints" / "step_000000004"
    shard = sorted(newest.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])  # a truncated shard file
    capsys.readouterr()
    assert (
        main(
            train_args(corpus, run_dir, "schedule.total_steps=6", "optim.lr=1e-3", *base)
            + ["--resume", "auto"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"resume auto: skipped {newest} (step 4): file {shard.name} has " in out, out
    assert "resumed from" in out and "at step 2" in out
    assert "warning: resuming with a changed setting: schedule.total_steps 4 -> 6" in out
    assert "warning: resuming with a changed setting: optim.lr 0.003 -> 0.001" in out
    assert sorted(train_losses(run_dir)) == [1, 2, 3, 4, 5, 6]
