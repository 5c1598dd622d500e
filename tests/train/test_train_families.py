"""The trainer takes any registered family (models/registry.py): Transformer++ trains through
the real `python -m gpn_scale train`, a checkpoint of one family is refused by another in
one line, and GPN-only options are refused by name. (FSDP2 on 2 ranks and kill -9 +
--resume auto per family: tests/parallel/test_parallel_strategies.py and
tests/train/test_train_resume.py, parametrised over families.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from train_helpers import PY, REPO, child_env, run_train, train_args, train_losses

FAMILY_MODELS = ["transformer_pp_tiny", "gated_deltanet_tiny"]


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert lines[0].startswith("gpn-scale: error: ")
    return lines[0]


def _train(tmp: Path, corpus: str, run_dir: Path, *overrides: str, resume: str | None = None):
    cmd = [PY, "-m", "gpn_scale", *train_args(corpus, run_dir, *overrides)]
    if resume:
        cmd += ["--resume", resume]
    return subprocess.run(
        cmd, cwd=REPO, env=child_env(tmp), text=True, capture_output=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize("model", FAMILY_MODELS)
def test_loss_falls_over_30_steps_on_the_embedded_corpus(corpus, tmp_path, model):
    run_dir = tmp_path / "run"
    proc = run_train(
        corpus,
        run_dir,
        f"model={model}",
        "schedule.total_steps=30",
        "checkpoint.every_steps=0",
        "optim.lr=1e-2",
    )
    assert f"train: {model} (" in proc.stdout
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, 31))
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (28, 29, 30)) / 3
    assert last < 0.7 * first, (first, last)  # byte-level: ln(512) ~ 6.2 -> below ~4
    # `gpn-scale eval` of the final checkpoint reproduces the run's own held-out loss.
    done = json.loads((run_dir / "checkpoints" / "DONE").read_text())
    proc = subprocess.run(
        [PY, "-m", "gpn_scale", "eval", *train_args(corpus, run_dir, f"model={model}")[1:]]
        + ["--json"],
        cwd=REPO,
        env=child_env(tmp_path),
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["step"] == 30 and result["eval/loss"] == done["final_eval_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("model", FAMILY_MODELS)
def test_a_checkpoint_of_one_family_is_refused_by_another_in_one_line(corpus, tmp_path, model):
    steps = ("schedule.total_steps=2", "checkpoint.every_steps=0", "eval.at_end=false")
    gpn_dir, other_dir = tmp_path / "gpn", tmp_path / "other"
    run_train(corpus, gpn_dir, *steps)
    run_train(corpus, other_dir, *steps, f"model={model}")
    gpn_ckpt = gpn_dir / "checkpoints" / "step_000000002"
    other_ckpt = other_dir / "checkpoints" / "step_000000002"
    line = _one_line(
        _train(tmp_path, corpus, tmp_path / "a", f"model={model}", resume=str(gpn_ckpt))
    )
    family = model.removesuffix("_tiny")
    assert f"checkpoint {gpn_ckpt} is a gpn model, not {family}" in line
    line = _one_line(_train(tmp_path, corpus, tmp_path / "b", resume=str(other_ckpt)))
    assert f"checkpoint {other_ckpt} is a {family} model, not gpn" in line
    # The same family with another shape names the fields.
    line = _one_line(
        _train(
            tmp_path,
            corpus,
            tmp_path / "c",
            f"model={model}",
            "model_overrides.n_layers=3",
            resume=str(other_ckpt),
        )
    )
    assert "another model shape (n_layers 2 != 3)" in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()  # nothing written


@pytest.mark.parametrize(
    "option, message",
    [
        ("train.tbptt=8", "train.tbptt: truncated BPTT is a GPN option"),
        ("train.stateful_windows=true", "train.stateful_windows: model=transformer_pp_tiny is"),
        ("model_overrides.step_backend=cpu", "model_overrides.step_backend: unknown key for"),
        ("engine.chunk_size=8", "engine.chunk_size: the engine options are GPN's"),
    ],
)
def test_gpn_only_options_are_refused_naming_the_field(tmp_path, option, message):
    run_dir = tmp_path / "run"
    proc = _train(tmp_path, str(tmp_path / "unused"), run_dir, "model=transformer_pp_tiny", option)
    assert message in _one_line(proc)
    assert not run_dir.exists()
