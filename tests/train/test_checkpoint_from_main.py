"""A checkpoint written by an earlier main (before GPN's code moved to models/gpn and its
sequence op to ops/gpn_step/chunk.py) still resumes, exactly: the step after it and the final
eval equal those of the run that wrote it. Checkpoints hold tensors and plain values only
(weights_only), so a module moving must never break one; this is the test that says so.

The fixture (tests/train/fixtures/checkpoint_from_main/: a 21k-parameter GPN+M and its AdamW
state, ~350 KB) was written on the embedded default corpus at seq_len 64; expected.json says by
what. That corpus is the stdlib's docstrings, so every Python patch release builds another (CI's
3.11.2 is not the 3.11.7 that wrote the fixture), and the losses hold only on the fixture's
data: it ships beside the checkpoint (corpus/, ~930 KB, as 3.11.7 built it), so the test runs
on any Python."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from train_helpers import read_metrics, train_args

from gpn_scale.cli import main
from gpn_scale.data import read_metadata

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_from_main"


# The engine options change how the step is computed, never what: a checkpoint resumes under
# other ones (here the run's engine: section, over the chunk the checkpoint's run used) to the
# same losses within float32 rounding.
OTHER_ENGINE = ["engine.chunk_size=5", "engine.loss_chunk_tokens=7"]


@pytest.mark.parametrize("engine", [[], OTHER_ENGINE], ids=["as-written", "other-engine-options"])
def test_a_checkpoint_written_by_main_resumes_to_the_same_losses(tmp_path, engine):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    # Copies: resuming leaves its sources alone, but a test never writes into the tree.
    corpus = str(shutil.copytree(FIXTURE / "corpus", tmp_path / "corpus"))
    manifest = json.loads((FIXTURE / "step_000000002" / "manifest.json").read_text())
    assert read_metadata(corpus).fingerprint == manifest["meta"]["loader"]["dataset"]
    ckpt = shutil.copytree(FIXTURE / "step_000000002", tmp_path / "from_main" / "step_000000002")
    run = tmp_path / "run"
    args = train_args(corpus, run, *expected["overrides"], *engine) + ["--resume", str(ckpt)]
    assert main(args) == 0
    rel = 1e-5 if engine else 1e-6
    rows = read_metrics(run)
    step3 = [r for r in rows if r.get("step") == 3 and "train/loss" in r]
    assert [r["step"] for r in rows if "train/loss" in r] == [3]  # resumed at step 2
    assert step3[0]["train/loss"] == pytest.approx(expected["step_3_train_loss"], rel=rel)
    assert step3[0]["grad_norm"] == pytest.approx(expected["step_3_grad_norm"], rel=1e-5)
    final = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert final == [pytest.approx(expected["final_eval_loss"], rel=rel)]
