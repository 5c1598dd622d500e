"""`gpn-scale export`: any checkpoint as safetensors + config.json + tokenizer (every family),
loadable back by the eval loader; Transformer++ as a Hugging Face Llama whose logits equal
ours; bad --out refused in one line before any work."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from eval_helpers import byte_dataset, save_checkpoint
from run_helpers import read_only, snapshot

from gpn_scale.cli import main
from gpn_scale.eval.load import load
from gpn_scale.io.storage import open_storage
from gpn_scale.models.registry import load_model_config

FAMILIES = ["tiny", "transformer_pp_tiny", "gated_deltanet_tiny"]


def family_checkpoint(tmp: Path, model: str, **overrides: object) -> str:
    """A DCP checkpoint (as the trainer saves it) of `model` with non-trivial weights."""
    spec, cfg = load_model_config(model, overrides=overrides or None)
    torch.manual_seed(0)
    net = spec.build(cfg).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return save_checkpoint(tmp / "run", net, byte_dataset(tmp / "data"))


def _call(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x, return_logits=True).logits


TOKENS = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model", FAMILIES)
def test_every_family_exports_and_loads_back(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = family_checkpoint(tmp_path, model)
    out = tmp_path / "exported"
    code, stdout, err = _call(capsys, "export", ckpt, "--out", str(out))
    assert code == 0, err
    assert f"loaded {ckpt}" in err and str(out) in stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json",
    ]  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["format"] == "gpn_scale.export/1" and config["step"] == 7
    assert config["family"] == load_model_config(model)[0].name
    assert config["source"] == ckpt and config["tokenizer"]["kind"] == "byte"
    from safetensors.torch import load_file

    original = load(ckpt, device="cpu")
    weights = load_file(str(out / "model.safetensors"))
    assert weights.keys() == original.model.state_dict().keys()
    back = load(str(out), device="cpu")  # the loader takes the export directory
    assert back.step == 7 and back.tokenizer.kind == "byte"
    torch.testing.assert_close(_logits(back.model, TOKENS), _logits(original.model, TOKENS))
    gen = ("--prompt", "ab", "--max-new-tokens", "5", "--temperature", "0", "--json")
    assert _call(capsys, "generate", str(out), *gen)[1] == _call(capsys, "generate", ckpt, *gen)[1]


def test_the_byte_tokenizer_file_encodes_as_the_byte_tokenizer(tmp_path: Path, capsys) -> None:
    from tokenizers import Tokenizer

    ckpt = family_checkpoint(tmp_path, "tiny")
    assert _call(capsys, "export", ckpt, "--out", str(tmp_path / "e"))[0] == 0
    tok = Tokenizer.from_file(str(tmp_path / "e" / "tokenizer.json"))
    text = "héllo wörld\n\t日本 "
    assert tok.encode(text + "<eod>", add_special_tokens=False).ids == [*text.encode(), 256]
    assert tok.token_to_id("<eod>") == 256 and tok.decode(list(b"abc")) == "abc"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformer_pp_as_a_hugging_face_llama_gives_our_logits(
    tied: bool, tmp_path: Path, capsys
) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    ckpt = family_checkpoint(tmp_path, "transformer_pp_tiny", tie_embeddings=tied)
    out = tmp_path / "hf"
    code, _, err = _call(capsys, "export", ckpt, "--out", str(out), "--format", "hf")
    assert code == 0, err
    hf = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = load(ckpt, device="cpu").model
    vocab = ours.config.vocab_size  # 512; id 512 is the start token, Llama's bos
    assert hf.config.bos_token_id == vocab and hf.config.vocab_size == vocab + 1
    inputs = torch.cat([torch.full((2, 1), vocab), TOKENS[:, :-1]], dim=1)
    with torch.no_grad():
        theirs = hf(input_ids=inputs).logits[..., :vocab]
    torch.testing.assert_close(theirs, _logits(ours, TOKENS), rtol=1e-5, atol=1e-5)
    # Its tokenizer prepends the start token, so `tok(text)` feeds Llama as we read text.
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok("abc").input_ids == [vocab, 97, 98, 99] and tok.eos_token_id == 256
    assert hf.generation_config.suppress_tokens == list(range(257, vocab + 1))
    back = load(str(out), device="cpu")  # and our loader reads the Llama layout back
    torch.testing.assert_close(_logits(back.model, TOKENS), _logits(ours, TOKENS))


def test_an_s3_step_exports(s3_bucket: str, tmp_path: Path, capsys) -> None:
    ckpt = Path(family_checkpoint(tmp_path, "tiny"))
    store = open_storage(f"{s3_bucket}/ckpt")
    for path in ckpt.rglob("*"):
        store.put_file(path, f"{ckpt.name}/{path.relative_to(ckpt).as_posix()}")
    data = f"{s3_bucket}/data"
    open_storage(data).put_bytes(
        "gpn_dataset.json", (tmp_path / "data" / "gpn_dataset.json").read_bytes()
    )
    s3_step = f"{s3_bucket}/ckpt/{ckpt.name}"
    code, _, err = _call(capsys, "export", s3_step, "--out", str(tmp_path / "e"))
    assert code == 0, err
    torch.testing.assert_close(
        _logits(load(str(tmp_path / "e"), device="cpu").model, TOKENS),
        _logits(load(str(ckpt), device="cpu").model, TOKENS),
    )


def test_a_bad_out_is_one_line_before_any_work(tmp_path: Path, capsys) -> None:
    ckpt = family_checkpoint(tmp_path, "tiny")
    out = tmp_path / "e"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, stdout, err = _call(capsys, "export", ckpt, "--out", str(out))
    assert code == 2 and stdout == "" and err.count("\n") == 1 and "--overwrite" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    code, _, err = _call(capsys, "export", ckpt, "--out", str(out / "keep.txt"))
    assert code == 2 and err.count("\n") == 1 and "is a file" in err
    code, _, err = _call(capsys, "export", ckpt, "--out", str(tmp_path / "h"), "--format", "hf")
    assert code == 2 and err.count("\n") == 1 and "gpn family has no Hugging Face" in err
    assert not (tmp_path / "h").exists()
    locked = tmp_path / "locked"
    locked.mkdir()
    before = snapshot(locked)
    with read_only(locked):
        code, _, err = _call(capsys, "export", ckpt, "--out", str(locked / "new"))
    assert code == 2 and err.count("\n") == 1 and "not writable" in err, err
    assert "loaded" not in err and snapshot(locked) == before  # refused before any work
    code, _, err = _call(capsys, "export", ckpt, "--out", str(out), "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json",
    ]  # fmt: skip
    assert not [p for p in tmp_path.iterdir() if ".export-" in p.name]  # no staging left
    assert os.access(out, os.W_OK)
