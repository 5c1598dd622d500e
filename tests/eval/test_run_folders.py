"""Run folders that travel: a finished run copied, moved or mounted read-only is evaluated,
sampled, analysed and exported as itself (its own checkpoints, its own data), the commands
say which checkpoint they loaded, and nothing is written where it may not be."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from run_helpers import copy_run, read_only, snapshot, train

from gpn_scale.cli import main

PASSAGES = '{"text": "Return the value of the"}\n{"text": "a new list of items"}\n'


def _call(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _abs(path: Path) -> str:
    return os.path.abspath(path)


def test_a_run_records_its_paths_relative_to_its_folder(finished_run: Path) -> None:
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    assert config["run_dir"] == "." and config["checkpoint"]["root"] == "checkpoints"
    assert config["data"]["remote"] == "default"
    done = json.loads((finished_run / "checkpoints" / "DONE").read_text())
    assert done["checkpoint"] == "step_000000002" and done["run_dir"] == ".."
    manifest = json.loads(
        (finished_run / "checkpoints" / "step_000000002" / "manifest.json").read_text()
    )
    assert manifest["meta"]["run_dir"] == ".."
    assert manifest["meta"]["config"]["checkpoint"]["root"] == "checkpoints"


def test_a_copy_scores_its_own_weights_after_the_original_is_retrained(
    finished_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, private_tmpdir
) -> None:
    copy_run(finished_run, tmp_path / "runs" / "x4")
    monkeypatch.chdir(tmp_path)
    Path("p.jsonl").write_text(PASSAGES)
    lambada = ("--task", "lambada", "--data", "p.jsonl", "--device", "cpu")
    assert _call(capsys, "eval", "runs/x4", *lambada, "--out", "before.json")[0] == 0
    gen = ("--prompt", "def ", "--max-new-tokens", "6", "--temperature", "0", "--json")
    code, before_gen, _ = _call(capsys, "generate", "runs/x4", *gen)
    assert code == 0
    shutil.copytree("runs/x4", "runs/x4_copy")  # cp -r runs/x4 runs/x4_copy
    train(tmp_path, "runs/x4", "seed=1", flags=("--fresh",))  # the original starts over

    code, out, err = _call(capsys, "eval", "runs/x4_copy", *lambada)
    assert code == 0, err
    mine = _abs(tmp_path / "runs" / "x4_copy" / "checkpoints" / "step_000000002")
    assert len(out.strip().splitlines()) == 1 and out.strip().endswith(f"{mine}.lambada.json")
    assert f"loaded {mine} (step 2" in err
    got = json.loads(Path(f"{mine}.lambada.json").read_text())
    assert got["checkpoint"] == mine
    assert got["metrics"] == json.loads(Path("before.json").read_text())["metrics"]
    assert not list(Path("runs/x4/checkpoints").glob("*.json"))  # nothing written there
    code, gen_out, err = _call(capsys, "generate", "runs/x4_copy", *gen)
    assert code == 0 and gen_out == before_gen and f"loaded {mine}" in err


def test_a_moved_run_with_the_original_gone_is_itself_for_every_command(
    finished_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, private_tmpdir
) -> None:
    src = copy_run(finished_run, tmp_path / "runs" / "x4")
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(src, moved)  # mv runs/x4 elsewhere/moved: the original is gone
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    mine = _abs(moved / "checkpoints" / "step_000000002")

    # The held-out eval takes the run folder itself: its config, data and checkpoints.
    code, out, err = _call(capsys, "eval", "../elsewhere/moved", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["checkpoint"] == mine and result["step"] == 2
    assert f"loaded {mine}" in err
    # The analyses find the run's own data (the default corpus built inside the folder).
    code, out, err = _call(
        capsys, "analyze", "../elsewhere/moved", "--out", "an", "--windows", "2",
        "--batch-size", "2", "--max-lag", "4", "--unigram-tokens", "0", "--device", "cpu",
    )  # fmt: skip
    assert code == 0, err
    assert f"analyze: loaded {mine}" in err
    source = json.loads(Path("an/analysis.json").read_text())["source"]
    assert source["checkpoint"] == mine
    assert source["data"] == _abs(moved / "data" / "default_corpus_T64")
    assert not Path("runs").exists()  # nothing went to the old relative location


def test_a_read_only_run_evaluates_with_its_outputs_elsewhere(
    finished_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, private_tmpdir
) -> None:
    run = copy_run(finished_run, tmp_path / "ro_run")
    monkeypatch.chdir(tmp_path)
    Path("p.jsonl").write_text(PASSAGES)
    before = snapshot(run)
    with read_only(run):
        code, out, err = _call(capsys, "eval", "ro_run", "--json")
        assert code == 0, err
        assert json.loads(out)["step"] == 2
        lambada = ("eval", "ro_run", "--task", "lambada", "--data", "p.jsonl")
        code, out, err = _call(capsys, *lambada)  # the default result file: beside it
        assert code == 2 and err.count("\n") == 1 and "--out" in err and "not writable" in err
        code, out, err = _call(capsys, *lambada, "--out", "l.json")
        assert code == 0, err
        code, out, err = _call(
            capsys, "generate", "ro_run", "--prompt", "a", "--max-new-tokens", "3"
        )
        assert code == 0, err
        code, out, err = _call(capsys, "export", "ro_run", "--out", "exported")
        assert code == 0, err
    assert snapshot(run) == before  # nothing written, nothing touched
    assert json.loads(Path("exported/config.json").read_text())["step"] == 2


def test_eval_device_cuda_without_cuda_is_refused(
    finished_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, private_tmpdir
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    run = copy_run(finished_run, tmp_path / "run")
    before = snapshot(run)
    code, out, err = _call(capsys, "eval", str(run), "--device", "cuda")
    assert code == 2 and out == "" and err.count("\n") == 1 and "CUDA is not available" in err
    code, out, err = _call(capsys, "eval", str(run), "--data", "x.jsonl")  # no --task
    assert code == 2 and err.count("\n") == 1 and "--task" in err
    assert snapshot(run) == before


def test_a_missing_step_folder_is_named_missing(finished_run: Path, tmp_path: Path, capsys) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    step = run / "checkpoints" / "step_000000099"
    for config in (["ci_tiny", f"run_dir={run}"], [str(run)]):
        code, _, err = _call(capsys, "eval", *config, "--checkpoint", str(step))
        assert code == 2 and err.count("\n") == 1 and "no such step folder (it is missing" in err
        assert "did not finish" not in err
    code, _, err = _call(capsys, "generate", str(step), "--prompt", "a")
    assert code == 2 and err.count("\n") == 1 and "no such step folder (it is missing)" in err


def test_eval_auto_beside_a_live_run_loads_the_newest_surviving_step(
    finished_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, private_tmpdir
) -> None:
    """The live run's retention deletes the step `eval --checkpoint auto` picked before it
    loads: the eval takes the newest complete one then, and says which."""
    from gpn_scale.checkpoint import CheckpointManager

    run = copy_run(finished_run, tmp_path / "run")
    root = run / "checkpoints"
    real_load = CheckpointManager.load
    deleted = []

    def load_after_retention(self, uri, app_state):  # the live run saves step 3 and
        if not deleted:  # retention drops step 2 between the pick and the load
            shutil.copytree(root / "step_000000002", root / "step_000000003")
            manifest = json.loads((root / "step_000000003" / "manifest.json").read_text())
            manifest["step"] = manifest["meta"]["step"] = 3  # as a save of step 3 says
            for entry in manifest["files"].values():
                entry.pop("mtime_ns", None)
            (root / "step_000000003" / "manifest.json").write_text(json.dumps(manifest))
            shutil.rmtree(root / "step_000000002")
            deleted.append(uri)
        return real_load(self, uri, app_state)

    monkeypatch.setattr(CheckpointManager, "load", load_after_retention)
    code, out, err = _call(capsys, "eval", str(run), "--json")
    assert code == 0, err
    assert deleted and deleted[0].endswith("step_000000002")
    assert json.loads(out)["checkpoint"].endswith("step_000000003")
    assert "deleted while loading" in err
