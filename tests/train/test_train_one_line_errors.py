"""Bad input met anywhere (config files, sweep files, the data mid-training, an explicit
--resume URI) ends in ONE line on stderr and exit 2, never a traceback (issue 13 item 3).
Real `python -m gpn_scale` processes: their whole stderr is what a user sees."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from train_helpers import PY, REPO, child_env, run_train, train_args


def _gpn_scale(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "gpn_scale", *args],
        cwd=REPO,
        env=child_env(tmp),
        text=True,
        capture_output=True,
        timeout=300,
    )


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert lines[0].startswith("gpn-scale: error: ")
    return lines[0]


@pytest.mark.parametrize("command", ["train", "sweep plan"])
def test_yaml_syntax_error_names_file_and_line(tmp_path, command):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\nschedule:\n  total_steps: 4\n  warmup_steps: : 2\n")
    line = _one_line(_gpn_scale(tmp_path, *command.split(), str(bad)))
    assert f"{bad}, line 4" in line and "YAML syntax error" in line


def test_yaml_syntax_error_in_a_model_config(tmp_path):
    bad = tmp_path / "model.yaml"
    bad.write_text("d_state: 16\nd_emb: [8, 16\n")
    line = _one_line(_gpn_scale(tmp_path, "train", "ci_tiny", f"model={bad}"))
    assert f"{bad}, line 3" in line and "model config" in line


def test_missing_data_remote_says_it_is_missing(tmp_path):
    missing = tmp_path / "no_such_dataset"
    line = _one_line(_gpn_scale(tmp_path, *train_args(str(missing), tmp_path / "run")))
    assert f"dataset directory {missing} is missing" in line


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_damaged_shard_met_in_training_is_one_line(corpus, tmp_path, damage):
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    shard = sorted((data / "train").glob("shard.*"))[0]
    if damage == "missing":
        shard.unlink()
    else:
        raw = bytearray(shard.read_bytes())
        raw[100:200] = bytes(100)
        shard.write_bytes(bytes(raw))
    line = _one_line(
        _gpn_scale(tmp_path, *train_args(str(data), tmp_path / "run", "checkpoint.every_steps=0"))
    )
    assert shard.name in line
    assert ("is missing" if damage == "missing" else "hash does not match") in line
    assert "decompress" not in line


@pytest.mark.slow
def test_explicit_resume_uri_of_another_model_shape_is_one_line(corpus, tmp_path):
    other = tmp_path / "other"
    run_train(
        corpus, other, "schedule.total_steps=1", "schedule.warmup_steps=0", "eval.at_end=false"
    )
    ckpt = other / "checkpoints" / "step_000000001"
    assert ckpt.is_dir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    line = _one_line(
        _gpn_scale(
            tmp_path,
            *train_args(corpus, run_dir, "model_overrides={d_ffn: 96}"),
            "--resume",
            str(ckpt),
        )
    )
    assert "another model shape" in line and "d_ffn 320 != 96" in line
    assert list(run_dir.iterdir()) == []  # a failed start: no checkpoints/, no data cache
