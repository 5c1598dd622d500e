"""`checkpoint.initial_load`: a run starts from another checkpoint's weights (any dp layout),
with a fresh optimizer, schedule and data position; refused in one line for another family
or shape; ignored once the run has a checkpoint of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_helpers import read_metrics, run_train

from gpn_scale.eval.load import load
from gpn_scale.optim import lr_at

TINY_LR = "optim.lr=1e-12"  # one update that cannot move the weights measurably


def _weights(ref: Path | str) -> dict[str, torch.Tensor]:
    return load(str(ref), device="cpu", with_tokenizer=False).model.state_dict()


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-8, msg=k)


@pytest.fixture(scope="module")
def source(corpus: str, once_per_run) -> Path:
    """A finished 2-step run (the weights to start from), trained once per test run."""

    def build(base: Path) -> None:
        run_train(corpus, base / "run", "schedule.total_steps=2", "checkpoint.every_steps=1")

    return once_per_run("warm_source", build) / "run"


def test_a_warm_start_takes_the_weights_and_starts_everything_else_fresh(
    corpus: str, source: Path, tmp_path: Path
) -> None:
    run = tmp_path / "warm"
    step2 = source / "checkpoints" / "step_000000002"
    proc = run_train(
        corpus, run, f"checkpoint.initial_load={source}", "schedule.total_steps=1", TINY_LR,
        "checkpoint.every_steps=1", "schedule.warmup_steps=1",
    )  # fmt: skip
    assert f"checkpoint.initial_load: weights of {step2} (step 2)" in proc.stdout
    assert "starting at step 0 (fresh optimizer, schedule and data position)" in proc.stdout
    ck = run / "checkpoints" / "step_000000001"
    _assert_same(_weights(ck), _weights(step2))  # the source's weights, one 1e-12 step on
    meta = json.loads((ck / "manifest.json").read_text())["meta"]
    assert meta["step"] == 1 and meta["initial_load"] == str(step2)
    step1 = source / "checkpoints" / "step_000000001"  # one batch into the same data
    assert meta["loader"] == json.loads((step1 / "manifest.json").read_text())["meta"]["loader"]
    (line,) = [r for r in read_metrics(run) if "lr" in r]
    assert line["step"] == 1 and line["lr"] == pytest.approx(lr_at(0, 1e-12, 1, 1, 0.1))
    # A fresh optimizer: one step of Adam state, not the source's two.
    optim = load_optimizer_steps(ck)
    assert optim == {1.0}

    # Its own checkpoint from now on: initial_load is ignored on the rerun.
    proc = run_train(
        corpus, run, f"checkpoint.initial_load={source}", "schedule.total_steps=2", TINY_LR,
        "checkpoint.every_steps=1", "schedule.warmup_steps=1",
    )  # fmt: skip
    assert "checkpoint.initial_load: ignored, the run resumes its own checkpoint" in proc.stdout
    assert "resumed from" in proc.stdout and "at step 1" in proc.stdout


def load_optimizer_steps(step_dir: Path) -> set[float]:
    """The Adam `step` counts saved in a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(step_dir))
    meta = reader.read_metadata()
    keys = [
        k for k in meta.state_dict_metadata if k.startswith("optim.state.") and k.endswith(".step")
    ]
    state = {
        k: torch.zeros(v.size) if isinstance(v, TensorStorageMetadata) else None
        for k, v in meta.state_dict_metadata.items()
        if k in keys
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {float(v) for v in state.values()}


def test_a_warm_start_of_another_family_or_shape_is_one_line(
    corpus: str, source: Path, tmp_path: Path
) -> None:
    run = tmp_path / "other"
    proc = run_train(
        corpus, run, f"checkpoint.initial_load={source}", "model=transformer_pp_tiny", check=False
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-2000:]
    assert "checkpoint.initial_load" in err[0] and "is a gpn model, not transformer_pp" in err[0]
    assert not run.exists()  # nothing written
    proc = run_train(
        corpus, run, f"checkpoint.initial_load={source}", "model_overrides.n_layers=2", check=False
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "another model shape" in err[0]
    assert "n_layers 1 != 2" in err[0] and not run.exists()
    proc = run_train(corpus, run, f"checkpoint.initial_load={tmp_path / 'nope'}", check=False)
    assert proc.returncode == 2 and "checkpoint.initial_load" in proc.stderr


def test_the_optimizer_state_comes_too_when_asked(
    corpus: str, source: Path, tmp_path: Path
) -> None:
    run = tmp_path / "with_optim"
    proc = run_train(
        corpus, run, f"checkpoint.initial_load={source}",
        "checkpoint.initial_load_model_only=false", "schedule.total_steps=1",
        "schedule.warmup_steps=1",
    )  # fmt: skip
    assert "weights and optimizer of" in proc.stdout
    assert load_optimizer_steps(run / "checkpoints" / "step_000000001") == {3.0}


@pytest.mark.slow
def test_a_warm_start_and_an_export_from_a_two_rank_fsdp2_checkpoint(
    corpus: str, tmp_path: Path
) -> None:
    """Another layout: the source trained on 2 FSDP2 ranks (DTensor shards), the warm start
    in one plain process and the export; DCP reassembles the weights."""
    src = tmp_path / "fsdp2"
    run_train(corpus, src, "schedule.total_steps=2", "parallel.backend=fsdp2", nproc=2)
    run = tmp_path / "warm"
    run_train(
        corpus, run, f"checkpoint.initial_load={src}", "schedule.total_steps=1", TINY_LR,
        "schedule.warmup_steps=1", "parallel.backend=none",
    )  # fmt: skip
    _assert_same(
        _weights(run / "checkpoints" / "step_000000001"),
        _weights(src / "checkpoints" / "step_000000002"),
    )
    # The same sharded step exports whole (gpn-scale export reads it through DCP too).
    from gpn_scale.cli import main

    exported = tmp_path / "exported"
    assert (
        main(["export", str(src / "checkpoints" / "step_000000002"), "--out", str(exported)]) == 0
    )
    _assert_same(_weights(exported), _weights(src / "checkpoints" / "step_000000002"))
    manifest = json.loads((src / "checkpoints" / "step_000000002" / "manifest.json").read_text())
    assert manifest["world_size"] == 2  # it was sharded
