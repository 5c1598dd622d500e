"""`gpn-scale eval CHECKPOINT --task lambada`, `--lm-eval`, and `gpn-scale generate`: outputs,
result files, and one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpn_scale.cli import main
from gpn_scale.eval.generate import Sampling, generate
from gpn_scale.eval.lambada import evaluate_lambada
from gpn_scale.eval.load import load

PASSAGES = ["the cat sat on the mat", "dogs bark loudly", "one two three four"]


@pytest.fixture
def lambada_file(tmp_path: Path) -> str:
    path = tmp_path / "lambada.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in PASSAGES))
    return str(path)


def _one_error_line(capsys: pytest.CaptureFixture[str], rc: int, match: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("gpn-scale: error: "), err
    assert match in err[0], err[0]


def test_lambada_writes_its_result_beside_the_checkpoint_and_never_overwrites_silently(
    checkpoint: str, lambada_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["eval", checkpoint, "--task", "lambada", "--data", lambada_file, "--device", "cpu"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    out = Path(checkpoint + ".lambada.json")
    assert line.startswith("lambada: accuracy ") and str(out) in line
    saved = json.loads(out.read_text())
    loaded = load(checkpoint, device="cpu")
    want = evaluate_lambada(loaded.model, loaded.tokenizer, PASSAGES)
    assert saved["metrics"] == pytest.approx(want)
    assert (saved["task"], saved["step"], saved["family"]) == ("lambada", 7, "gpn")

    before = out.read_text()
    _one_error_line(capsys, main(argv), "pass --overwrite")
    assert out.read_text() == before
    assert main([*argv, "--overwrite", "--json", "--limit", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["metrics"]["examples"] == 2
    assert json.loads(out.read_text())["metrics"]["examples"] == 2


def test_generate_prints_the_greedy_continuation_of_each_prompt(
    checkpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", checkpoint, "--prompt", "the ", "--prompt", "a much longer prompt"]
    argv += ["--temperature", "0", "--max-new-tokens", "5", "--json", "--device", "cpu"]
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    loaded = load(checkpoint, device="cpu")
    tok = loaded.tokenizer
    want = generate(
        loaded.model,
        [tok.encode("the "), tok.encode("a much longer prompt")],
        Sampling(max_new_tokens=5, temperature=0, stop_tokens=frozenset({tok.eod_token_id})),
        decode=tok.decode,
    )
    assert [g["tokens"] for g in got] == [w.tokens for w in want]
    assert [g["prompt"] for g in got] == ["the ", "a much longer prompt"]


@pytest.mark.parametrize(
    "args, match",
    [
        (["eval", "{tmp}/missing", "--task", "lambada", "--data", "{data}"], "no such file"),
        (["eval", "{ckpt}", "--task", "lambda", "--data", "{data}"], "did you mean 'lambada'"),
        (["eval", "{ckpt}", "--task", "lambada"], "needs --data"),
        (["eval", "{ckpt}", "--task", "lambada", "--data", "{tmp}/x.jsonl"], "not found"),
        (["eval", "{ckpt}", "--task", "lambada", "--data", "{data}", "--batch-size", "0"], ">= 1"),
        (["eval", "{ckpt}", "--task", "lambada", "--data", "{data}", "--limit", "0"], ">= 1"),
        (["eval", "{ckpt}", "--task", "lambada", "--data", "{data}", "a=1"], "flags only"),
        (["eval", "{ckpt}", "--lm-eval", ","], "at least one task"),
        (["eval", "{ckpt}", "--task", "lambada", "--data", "{data}", "--device", "cuda:x"], "cuda"),
        (["generate", "{ckpt}"], "at least one --prompt"),
        (["generate", "{ckpt}", "--prompt", "x", "--top-p", "2"], "--top-p 2.0"),
        (["generate", "{ckpt}", "--prompt", "x", "--temperature", "-1"], "--temperature"),
        (["generate", "{ckpt}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["generate", "{ckpt}", "--prompt", "x", "--stop-token", "999"], "--stop-token 999"),
        (["generate", "{tmp}/nope.pt", "--prompt", "x"], "no such file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str],
    match: str,
    gpn_m_checkpoint: str,
    lambada_file: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [a.format(tmp=tmp_path, data=lambada_file, ckpt=gpn_m_checkpoint) for a in args]
    _one_error_line(capsys, main(argv), match)
    assert not list(Path(gpn_m_checkpoint).parent.glob("*.json"))  # nothing written
