"""The loader and the eval commands on checkpoints as the trainer and S3 hold them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from eval_helpers import byte_dataset, save_checkpoint

from gpn_scale.cli import main
from gpn_scale.core.config import ConfigError
from gpn_scale.eval.load import load
from gpn_scale.io.storage import open_storage
from gpn_scale.testing.models import perturbed_model, tiny_config

REPO = Path(__file__).resolve().parents[2]


def test_an_s3_checkpoint_loads_and_its_result_lands_beside_it(
    s3_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = perturbed_model(tiny_config(vocab_size=257), dtype=torch.float32).eval()
    # The checkpoint and the dataset metadata both on S3 (the trainer's S3 layout).
    data = f"{s3_bucket}/data"
    local_meta = byte_dataset(tmp_path / "data")
    open_storage(data).put_bytes(
        "gpn_dataset.json", (Path(local_meta) / "gpn_dataset.json").read_bytes()
    )
    uri = save_checkpoint(tmp_path / "run", model, data)
    s3_root = f"{s3_bucket}/ckpt"
    store = open_storage(s3_root)
    for path in Path(uri).parent.rglob("*"):
        if path.is_file() and ".staging" not in path.parts:
            store.put_file(path, str(path.relative_to(Path(uri).parent)))
    s3_ckpt = f"{s3_root}/step_000000007"
    loaded = load(s3_root, device="cpu")
    assert loaded.checkpoint == s3_ckpt and loaded.tokenizer.kind == "byte"
    passages = tmp_path / "l.jsonl"
    passages.write_text('{"text": "a b c"}\n{"text": "the end of it"}\n')
    argv = ["eval", s3_ckpt, "--task", "lambada", "--data", str(passages), "--device", "cpu"]
    assert main(argv) == 0
    assert json.loads(store.get_bytes("step_000000007.lambada.json") or b"{}")["step"] == 7
    assert main(argv) == 2 and "--overwrite" in capsys.readouterr().err


@pytest.mark.slow
def test_a_trained_run_evaluates_from_its_run_dir_and_its_model_final(tmp_path: Path) -> None:
    """A real `gpn-scale train` run: the DCP checkpoint and model_final.pt give one result."""
    from data_tools.default_corpus import build_default_dataset

    corpus = build_default_dataset(str(tmp_path / "corpus"), seq_len=64, seed=0)
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    train = [
        sys.executable, "-m", "gpn_scale", "train", "ci_tiny", f"data.remote={corpus}",
        "data.seq_len=64", f"run_dir={run}", "schedule.total_steps=2",
        "checkpoint.export_final=true",
    ]  # fmt: skip
    proc = subprocess.run(train, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    passages = tmp_path / "l.jsonl"
    passages.write_text('{"text": "Return the value of the"}\n{"text": "a new list of items"}\n')
    results = []
    for ref in (run, run / "model_final.pt"):
        out = tmp_path / f"{ref.name}.json"
        argv = ["eval", str(ref), "--task", "lambada", "--data", str(passages), "--out", str(out)]
        assert main([*argv, "--device", "cpu"]) == 0
        results.append(json.loads(out.read_text()))
    assert results[0]["step"] == 2 and results[0]["checkpoint"].endswith("step_000000002")
    assert results[0]["metrics"] == pytest.approx(results[1]["metrics"])
    assert main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    # The checkpoint names its tokenizer itself: with the training data gone it still loads.
    import shutil

    shutil.rmtree(corpus)
    loaded = load(str(run), device="cpu")
    assert loaded.tokenizer.kind == "byte" and loaded.step == 2
    with pytest.raises(ConfigError, match="cannot read the training data's tokenizer"):
        load(str(run / "model_final.pt"), device="cpu")  # no manifest: the data decides
