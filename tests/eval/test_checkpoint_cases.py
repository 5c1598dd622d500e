"""Checkpoint readers on the inputs a new user gets wrong: a padded vocabulary, a model
config of another family, another tokenizer or dataset, Ctrl-C during generation. Each is
one line (exit 2) or, for Ctrl-C, the text so far and exit 130; nothing is written."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from eval_helpers import byte_dataset, save_checkpoint
from run_helpers import REPO, copy_run, env, snapshot

from gpn_scale.cli import main
from gpn_scale.data.metadata import DatasetMetadata, SplitInfo, write_metadata
from gpn_scale.data.tokenizer import ByteTokenizer
from gpn_scale.eval.generate import Sampling, generate
from gpn_scale.testing.models import perturbed_model, tiny_config


def _call(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def padded_checkpoint(tmp_path: Path) -> str:
    """A tiny GPN+M with 512 logits for the 257-id byte tokenizer (tiny.yaml's padding)."""
    model = perturbed_model(tiny_config(vocab_size=512), dtype=torch.float32, scale=0.3).eval()
    return save_checkpoint(tmp_path / "run", model, byte_dataset(tmp_path / "data"))


def test_generate_never_samples_padded_vocabulary_ids(padded_checkpoint: str, capsys) -> None:
    code, out, err = _call(
        capsys, "generate", padded_checkpoint, "--prompt", "the ", "--prompt", "a b",
        "--max-new-tokens", "48", "--temperature", "1.5", "--seed", "3", "--json",
    )  # fmt: skip
    assert code == 0, err
    tokens = [t for g in json.loads(out) for t in g["tokens"]]
    assert tokens and max(tokens) < 257  # 255 of 512 ids are padding: drawn often otherwise


def test_lm_eval_generate_until_masks_the_padded_ids_too(padded_checkpoint: str) -> None:
    from gpn_scale.eval.lm_eval_adapter import GPNScaleLM
    from gpn_scale.eval.load import load

    loaded = load(padded_checkpoint, device="cpu")
    lm = GPNScaleLM(model=loaded.model, tok=loaded.tokenizer, device="cpu")
    sampling = lm._sampling({"until": ["zz"], "do_sample": True, "temperature": 1.5})
    assert sampling.vocab_limit == 257
    gens = generate(loaded.model, [list(b"the ")], Sampling(max_new_tokens=48, seed=3))
    assert max(gens[0].tokens) >= 257  # the model does put mass there: the mask matters
    masked = generate(
        loaded.model, [list(b"the ")], Sampling(max_new_tokens=48, seed=3, vocab_limit=257)
    )
    assert max(masked[0].tokens) < 257
    request = SimpleNamespace(args=("the ", {"until": ["zz"], "do_sample": True}))
    assert isinstance(lm.generate_until([request])[0], str)


def test_generate_with_a_model_config_of_another_family_is_one_line(
    gpn_m_checkpoint: str, capsys
) -> None:
    code, out, err = _call(
        capsys, "generate", gpn_m_checkpoint, "--prompt", "a", "--model-config",
        "transformer_pp_tiny",
    )  # fmt: skip
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "holds a gpn model, not transformer_pp" in err and "Traceback" not in err
    code, _, err = _call(
        capsys, "generate", gpn_m_checkpoint, "--prompt", "a", "--model-config", "tiny_2l"
    )
    assert code == 2 and err.count("\n") == 1 and "another shape" in err and "n_layers" in err


def _hf_tokenizer_file(path: Path) -> Path:
    from gpn_scale.eval.export import hf_tokenizer

    path.write_text(hf_tokenizer(ByteTokenizer()).to_str())
    return path


def test_another_tokenizer_than_the_recorded_one_is_refused(
    finished_run: Path, tmp_path: Path, capsys, private_tmpdir
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    other = _hf_tokenizer_file(tmp_path / "other_tokenizer.json")
    code, out, err = _call(capsys, "generate", str(run), "--prompt", "a", "--tokenizer", str(other))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "is not the tokenizer" in err and "byte:byte" in err
    code, out, _ = _call(capsys, "generate", str(run), "--prompt", "a", "--tokenizer", "byte")
    assert code == 0 and out.startswith("a")  # the same tokenizer, named explicitly: fine


def _other_dataset(root: Path) -> str:
    """A dataset (metadata) tokenized with a Hugging Face tokenizer, not the byte one."""
    meta = DatasetMetadata(
        vocab_size=257,
        seq_len=64,
        tokenizer={
            "kind": "huggingface",
            "name": "gpt-x",
            "sha256": "ab" * 32,
            "eod_token_id": 256,
        },
        eod_token_id=256,
        splits={"train": SplitInfo(64, 64 * 64, 1), "val": SplitInfo(64, 64 * 64, 1)},
        source={"description": "test"},
        seed=0,
    )
    root.mkdir(parents=True)
    write_metadata(str(root), meta)
    return str(root)


def test_data_of_another_tokenizer_is_refused_by_eval_and_analyze(
    finished_run: Path, tmp_path: Path, capsys, private_tmpdir
) -> None:
    run = copy_run(finished_run, tmp_path / "run")
    other = _other_dataset(tmp_path / "other")
    before = snapshot(run)
    code, out, err = _call(capsys, "eval", str(run), f"data.remote={other}")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "tokenized with huggingface:gpt-x" in err and "trained with byte:byte" in err
    out_dir = tmp_path / "an"
    code, out, err = _call(capsys, "analyze", str(run), "--data", other, "--out", str(out_dir))
    assert code == 2 and err.count("\n") == 1 and "tokenized with huggingface:gpt-x" in err
    assert not out_dir.exists() and snapshot(run) == before


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_ctrl_c_during_generate_keeps_the_text_so_far_and_exits_130(
    finished_run: Path, tmp_path: Path
) -> None:
    # (the trained tiny run's greedy text never reaches end-of-document: it decodes on)
    cmd = [
        sys.executable, "-m", "gpn_scale", "generate", str(finished_run), "--prompt", "abc",
        "--max-new-tokens", "200000", "--temperature", "0", "--device", "cpu",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A job started in the background inherits SIGINT ignored; a terminal's Ctrl-C is not.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: queue.Queue[str] = queue.Queue()
    chunks: list[str] = []
    assert proc.stderr is not None and proc.stdout is not None
    readers = [
        threading.Thread(target=lambda f=proc.stderr: [lines.put(x) for x in f], daemon=True),
        threading.Thread(target=lambda f=proc.stdout: chunks.append(f.read()), daemon=True),
    ]
    for reader in readers:
        reader.start()
    seen: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any("loaded" in x for x in seen):
        with contextlib.suppress(queue.Empty):  # decoding once the checkpoint is loaded
            seen.append(lines.get(timeout=1))
    # Let it decode for 2 s of its own CPU time (thousands of tokens for the tiny model), not
    # 2 s of wall time: on a loaded machine (the suite's other worker) that was none at all.
    start = _cpu_seconds(proc.pid)
    while time.monotonic() < deadline and _cpu_seconds(proc.pid) - start < 2.0:
        time.sleep(0.2)
    assert proc.poll() is None, "generate ended before Ctrl-C"
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()
    for reader in readers:
        reader.join(timeout=10)
    while not lines.empty():
        seen.append(lines.get())
    err, out = "".join(seen), "".join(chunks)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "interrupted by Ctrl-C" in err
    assert out.startswith("abc") and len(out.strip()) > len("abc") + 10  # the text so far


def test_a_hugging_face_tokenizer_travels_with_the_checkpoint(tmp_path: Path) -> None:
    """The trainer keeps the dataset's tokenizer.json in every step directory: eval finds it
    there when the file at the recorded path is gone (a moved run, another machine)."""
    from data_tools.tokenizer import resolve_tokenizer
    from gpn_scale.checkpoint import CheckpointManager
    from gpn_scale.eval.load import load
    from gpn_scale.run.sources import tokenizer_record

    path = _hf_tokenizer_file(tmp_path / "tok.json")
    identity, files = tokenizer_record(resolve_tokenizer(str(path), "<eod>").identity())
    assert identity["name"] == str(path) and set(files) == {"tokenizer.json"}
    model = perturbed_model(tiny_config(vocab_size=257), dtype=torch.float32).eval()
    meta = {"step": 1, "model_config": model.config.to_dict(), "tokenizer": identity}
    mgr = CheckpointManager(str(tmp_path / "ckpt"))
    uri = mgr.save(1, {"model": model.state_dict()}, meta=meta, files=files)
    path.unlink()  # the recorded path is gone
    loaded = load(uri, device="cpu")
    assert loaded.tokenizer.kind == "huggingface" and loaded.tokenizer.encode("ab") == [97, 98]
    (Path(uri) / "tokenizer.json").write_text(
        _hf_tokenizer_file(tmp_path / "x.json").read_text()[:-2]
    )
    with pytest.raises(Exception, match="sha256|does not match|parse"):
        load(uri, device="cpu")  # a damaged copy is never used silently
