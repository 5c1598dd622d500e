"""LAMBADA scoring against a hand computation on a model with known logits."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from fake_lm import V, bigram

from gpn_scale.core.config import ConfigError
from gpn_scale.data.tokenizer import ByteTokenizer
from gpn_scale.eval.lambada import encode_example, evaluate_lambada, read_texts
from gpn_scale.eval.scoring import score_continuations


def _lp(logit: float, others: int = V - 1) -> float:
    """log p of a token with `logit` when the other V-1 tokens have logit 0."""
    return logit - math.log(math.exp(logit) + others)


def test_first_subword_accuracy_and_token_weighted_ppl_match_a_hand_computation(
    tmp_path: Path,
) -> None:
    # After " " the model prefers "c"; after "c" it prefers "d"; after "x" it prefers "q".
    model = bigram({(" ", "c"): 3.0, ("c", "d"): 2.0, ("x", "q"): 4.0})
    data = tmp_path / "lambada.jsonl"
    rows = ["a b cx", "a b xd"]  # last words "cx" and "xd" (two subwords each)
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    tok = ByteTokenizer()
    texts = read_texts(str(data))
    # The space before the last word is context, not the word's first subword.
    assert encode_example(tok, texts[0]) == (list(b"a b "), list(b"cx"))
    got = evaluate_lambada(model, tok, texts, batch_size=2)
    # passage 1: p(c | " ") top-1 (right first subword), p(x | c): "d" is top-1 (wrong).
    # passage 2: p(x | " "): "c" is top-1 (wrong first subword); p(d | x): "q" is top-1.
    nll = [
        -(_lp(3.0) + (0.0 - math.log(math.exp(2.0) + V - 1))),
        -((0.0 - math.log(math.exp(3.0) + V - 1)) + (0.0 - math.log(math.exp(4.0) + V - 1))),
    ]
    assert got["examples"] == 2 and got["last_word_tokens"] == 4
    assert got["accuracy"] == 0.5  # only the first subword counts
    assert got["acc_full_word"] == 0.0  # neither word is top-1 in full
    assert got["ppl"] == pytest.approx(math.exp(sum(nll) / 4), rel=1e-12)
    assert got["word_ppl"] == pytest.approx(math.exp(sum(nll) / 2), rel=1e-12)


def test_the_context_runs_once_and_the_word_is_scored_from_its_state() -> None:
    model = bigram({(" ", "c"): 3.0})
    texts = ["one two three", "uno dos", "a bc"]
    evaluate_lambada(model, ByteTokenizer(), texts, batch_size=8)
    contexts = sum(len(t.rpartition(" ")[0]) + 1 for t in texts)
    words = sum(len(t.rpartition(" ")[2]) for t in texts)
    # Three context lengths: three context runs, then each word from its context's state
    # (a word is padded only to its own length): every token is fed exactly once.
    assert model.tokens_seen == contexts + words


def test_continuations_of_one_context_reuse_its_state() -> None:
    model = bigram({})
    ctx = list(b"shared context")
    conts = [list(b" a"), list(b" bb"), list(b" ccc")]
    reused = score_continuations(model, [(ctx, c) for c in conts], batch_size=8)
    assert model.tokens_seen == len(ctx) + 3 * 4  # the context once, three padded words
    model.tokens_seen = 0
    again = score_continuations(model, [(ctx, c) for c in conts], batch_size=8, reuse=False)
    assert model.tokens_seen == 3 * (len(ctx) + 4)
    for a, b in zip(reused, again):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=0)


def test_gpn_scores_equal_the_full_forward(byte_model: torch.nn.Module) -> None:
    """Scoring from the carried state == one forward over context + word (GPN / GPN+M)."""
    tok = ByteTokenizer()
    texts = ["the cat sat on the mat", "dogs bark", "a b c d efg"]
    got = evaluate_lambada(byte_model, tok, texts, batch_size=2)
    nll, first_ok, n_tok = 0.0, 0, 0
    for t in texts:
        ctx, cont = encode_example(tok, t)
        x = torch.tensor([ctx + cont])
        with torch.no_grad():
            logits = byte_model(x, return_logits=True).logits
        logp = torch.log_softmax(logits.double(), -1)[0]
        rows = logp[len(ctx) :]
        nll -= float(rows.gather(-1, torch.tensor(cont)[:, None]).sum())
        first_ok += int(rows[0].argmax() == cont[0])
        n_tok += len(cont)
    assert got["ppl"] == pytest.approx(math.exp(nll / n_tok), rel=1e-5)
    assert got["accuracy"] == first_ok / len(texts)


def test_bad_data_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        read_texts(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a b"}\n{"txt": "c d"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: expected an object with a 'text'"):
        read_texts(str(bad))
    with pytest.raises(ConfigError, match="at least two words"):
        encode_example(ByteTokenizer(), "lonely")


def test_hf_data_without_datasets_or_offline_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("datasets")
    with pytest.raises(ConfigError, match=r"^--data hf:no-such/dataset: cannot load it") as err:
        read_texts("hf:no-such/dataset")
    assert "\n" not in str(err.value)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match=r"`datasets` library is not installed.*\[eval\]"):
        read_texts("hf:EleutherAI/lambada_openai")


class _SlotState:
    """Like Gated DeltaNet's per-layer carry: a plain class with __slots__."""

    __slots__ = ("memory", "conv")

    def __init__(self, memory: torch.Tensor, conv: torch.Tensor) -> None:
        self.memory, self.conv = memory, conv


def test_select_state_indexes_every_state_shape_of_the_families() -> None:
    from dataclasses import dataclass

    from gpn_scale.eval.scoring import StateNotIndexable, select_state

    @dataclass(frozen=True)
    class Outer:
        layers: tuple
        pending: torch.Tensor
        length: int

    B = 3
    state = Outer(
        (_SlotState(torch.arange(B * 4.0).reshape(B, 2, 2), torch.arange(B * 5.0).reshape(B, 5)),),
        torch.tensor([7, 8, 9]),
        11,
    )
    sub = select_state(state, torch.tensor([2, 0]), B)
    assert sub.length == 11 and sub.pending.tolist() == [9, 7]
    torch.testing.assert_close(sub.layers[0].memory, state.layers[0].memory[[2, 0]])
    torch.testing.assert_close(sub.layers[0].conv, state.layers[0].conv[[2, 0]])
    with pytest.raises(StateNotIndexable):  # a tensor without the batch first
        select_state((torch.zeros(B, 2), torch.zeros(2, B)), torch.tensor([0]), B)
