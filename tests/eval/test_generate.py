"""Decoding with the carried state (gpn_scale/eval/generate.py)."""

from __future__ import annotations

import pytest
import torch
from fake_lm import bigram

from gpn_scale.core.config import ConfigError
from gpn_scale.data.tokenizer import ByteTokenizer
from gpn_scale.eval.generate import Sampling, filter_logits, generate

PROMPTS = [list(b"the "), list(b"a longer prompt "), list(b"x"), list(b"the ")]


def test_greedy_decoding_is_the_argmax_of_the_full_forward_step_by_step(
    byte_model: torch.nn.Module,
) -> None:
    out = generate(byte_model, PROMPTS, Sampling(max_new_tokens=6, temperature=0), batch_size=3)
    assert [g.stopped for g in out] == ["length"] * 4
    for prompt, g in zip(PROMPTS, out):
        seq = torch.tensor([prompt + g.tokens])
        with torch.no_grad():
            logits = byte_model(seq, return_logits=True).logits[0]
        # logits[t] predicts token t: each new token is the argmax given everything before it
        want = logits[len(prompt) : len(prompt) + 6].argmax(-1).tolist()
        assert g.tokens == want


def test_sampling_is_reproducible_by_seed_and_independent_of_batching(
    byte_model: torch.nn.Module,
) -> None:
    s = Sampling(max_new_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=3)
    a = generate(byte_model, PROMPTS, s, batch_size=4)
    b = generate(byte_model, PROMPTS, s, batch_size=1)
    c = generate(byte_model, PROMPTS, Sampling(max_new_tokens=8, temperature=1.0, seed=4))
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.tokens for g in a] != [g.tokens for g in c]


def test_stop_tokens_and_strings_end_each_row_on_its_own() -> None:
    # After "a" comes "b", after "b" comes "c", ...: greedy spells the alphabet.
    model = bigram({(chr(c), chr(c + 1)): 9.0 for c in range(ord("a"), ord("z"))})
    tok = ByteTokenizer()
    prompts = [list(b"a"), list(b"xa"), list(b"k")]
    s = Sampling(
        max_new_tokens=5, temperature=0, stop_strings=("de",), stop_tokens=frozenset({ord("m")})
    )
    out = generate(model, prompts, s, decode=tok.decode)
    assert (out[0].text, out[0].stopped, out[0].tokens) == ("bc", "string", list(b"bcde"))
    assert out[1].text == "bc" and out[1].stopped == "string"
    assert (out[2].text, out[2].stopped, out[2].tokens) == ("l", "token", list(b"lm"))


def test_decoding_never_recomputes_the_prompt() -> None:
    model = bigram({})
    generate(model, [list(b"hello world")], Sampling(max_new_tokens=5, temperature=0))
    assert model.tokens_seen == len(b"hello world") + 4  # the last token is never fed


def test_filters_and_bad_settings() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    kept = ~torch.isinf(filter_logits(logits, 0, 0.5))
    assert kept.tolist() == [[True, False, False, False]]  # the top token alone holds > 0.5
    for bad in (
        dict(max_new_tokens=0),
        dict(temperature=-1.0),
        dict(top_k=-2),
        dict(top_p=0.0),
        dict(stop_strings=("",)),
    ):
        with pytest.raises(ConfigError):
            Sampling(**bad)  # type: ignore[arg-type]
