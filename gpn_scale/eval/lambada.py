"""LAMBADA as the paper measures it (the EleutherAI split: 5,153 passages, JSONL `text`).

Protocol (EleutherAI's lambada_openai split of each passage): context = the text before its
last space, target = " " + the last word. Tokens: the context is encoded alone and the
continuation is what encoding context + target adds after it (so a tokenizer that merges
across the boundary is handled as lm-eval handles it); continuation tokens that are only
whitespace (a byte tokenizer's " ") are moved into the context, since they are not part of
the word. Then, with the context run once and the word scored from its state:
  - accuracy: the FIRST subword of the last word is the model's top-1 given the context;
  - ppl: exp(mean cross-entropy over all last-word subwords, token-weighted);
  - also reported: acc_full_word (every subword top-1, lm-eval's `acc` for lambada) and
    word_ppl (exp of the mean per-word summed CE, lm-eval's `perplexity`), for comparison.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpn_scale.core.config import ConfigError
from gpn_scale.data.tokenizer import Tokenizer
from gpn_scale.eval.scoring import score_continuations

HF_DEFAULT_SPLIT = "test"


def read_texts(data: str, limit: int | None = None) -> list[str]:
    """Passages from a JSONL file (one {"text": ...} a line) or `hf:NAME[:CONFIG]` (the
    `datasets` library, split "test")."""
    if data.startswith("hf:"):
        return _read_hf(data[3:], limit)
    path = Path(data)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "not found"
        raise ConfigError(f"--data {data}: {what}; give a JSONL file with a 'text' per line")
    texts: list[str] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"--data {data}:{n}: not JSON ({err.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ConfigError(f"--data {data}:{n}: expected an object with a 'text' string")
            texts.append(row["text"])
            if limit is not None and len(texts) >= limit:
                break
    if not texts:
        raise ConfigError(f"--data {data}: no passages in it")
    return texts


def _read_hf(spec: str, limit: int | None) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "--data hf:...: the `datasets` library is not installed; pip install "
            "'gpn_scale[eval]' or give a local JSONL file"
        ) from None
    name, _, config = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=HF_DEFAULT_SPLIT)
    except Exception as err:  # noqa: BLE001 - offline, unknown name: one line either way
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
        raise ConfigError(
            f"--data hf:{spec}: cannot load it ({type(err).__name__}: {first}); give a local "
            "JSONL file"
        ) from None
    texts = [str(t) for t in ds["text"]]
    return texts[:limit] if limit is not None else texts


def split_passage(text: str, where: str = "passage") -> tuple[str, str]:
    """(context, target) with target = " " + the last word."""
    text = text.rstrip()
    context, sep, word = text.rpartition(" ")
    if not sep or not context or not word:
        raise ConfigError(f"{where}: needs at least two words to have a last word to predict")
    return context, " " + word


def encode_example(
    tok: Tokenizer, text: str, where: str = "passage"
) -> tuple[list[int], list[int]]:
    """(context ids, last-word ids) by the rule in the module docstring."""
    context, target = split_passage(text, where)
    ctx = tok.encode(context)
    whole = tok.encode(context + target)
    cont = whole[len(ctx) :] if whole[: len(ctx)] == ctx else tok.encode(target)
    while len(cont) > 1 and tok.decode(cont[:1]).strip() == "":
        ctx.append(cont.pop(0))
    if not cont:
        raise ConfigError(f"{where}: its last word encodes to no tokens")
    return ctx, cont


def evaluate_lambada(
    model: Any,
    tok: Tokenizer,
    texts: Sequence[str],
    *,
    batch_size: int = 16,
    device: Any = "cpu",
) -> dict[str, Any]:
    """The LAMBADA metrics of `model` over `texts` (see the module docstring)."""
    requests = [encode_example(tok, t, f"passage {i + 1}") for i, t in enumerate(texts)]
    scores = score_continuations(model, requests, batch_size=batch_size, device=device)
    first_ok = sum(int(s.argmax[0] == s.tokens[0]) for s in scores)
    full_ok = sum(int(s.greedy) for s in scores)
    nll = [-s.total for s in scores]
    n_tok = sum(len(s.tokens) for s in scores)
    n = len(scores)
    return {
        "accuracy": first_ok / n,
        "ppl": math.exp(min(sum(nll) / n_tok, 700.0)),
        "acc_full_word": full_ok / n,
        "word_ppl": math.exp(min(sum(nll) / n, 700.0)),
        "examples": n,
        "last_word_tokens": n_tok,
        "protocol": "context = text before the last space; accuracy = top-1 of the first "
        "subword of the last word; ppl = exp(mean CE over the last word's subwords)",
    }
