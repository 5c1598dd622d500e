"""The lm-evaluation-harness adapter on tiny LOCAL tasks through the harness's own evaluator
(no network: JSONL files read by `datasets`' json builder, task YAMLs in a temp dir)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from eval_helpers import ROLL_DOCS, write_tasks
from fake_lm import V, bigram

lm_eval = pytest.importorskip("lm_eval")

from gpn_scale.data.tokenizer import ByteTokenizer  # noqa: E402
from gpn_scale.eval.lm_eval_adapter import GPNScaleLM  # noqa: E402


def alphabet_model():
    pairs = {(chr(c), chr(c + 1)): 9.0 for c in range(ord("a"), ord("z"))}
    pairs[(" ", "c")] = 3.0
    return bigram(pairs)


def run(lm: GPNScaleLM, tasks: Path, names: list[str]) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=lm, tasks=names, task_manager=TaskManager(include_path=str(tasks)), limit=None
    )


def test_the_harness_scores_local_tasks_through_the_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = write_tasks(tmp_path)
    model = alphabet_model()
    lm = GPNScaleLM(model=model, tok=ByteTokenizer(), device="cpu", batch_size=4)
    out = run(lm, tasks, ["gpn_tiny_choice", "gpn_tiny_gen", "gpn_tiny_roll"])["results"]
    assert out["gpn_tiny_choice"]["acc,none"] == 1.0
    assert out["gpn_tiny_gen"]["exact_match,none"] == 1.0  # "a" -> "bcd" (stops at "e")

    # word perplexity by hand: each text scored from the initial state (start row: all 0),
    # then along the alphabet (logit 9 for the next letter) or uniform otherwise.
    def nll(text: str) -> float:
        total = math.log(V)  # the first letter, from the start row (all logits 0)
        for prev, ch in zip(text, text[1:]):  # a letter's row: 9 for the next letter
            total += math.log(math.exp(9.0) + V - 1) - (9.0 if ord(ch) == ord(prev) + 1 else 0)
        return total

    words = len(ROLL_DOCS)  # one word each
    want = math.exp(sum(nll(d["text"]) for d in ROLL_DOCS) / words)
    assert out["gpn_tiny_roll"]["word_perplexity,none"] == pytest.approx(want, rel=1e-9)


def test_loglikelihood_equals_a_full_forward_on_gpn(
    byte_model: torch.nn.Module,
) -> None:
    """Context state reuse inside the adapter == scoring context + continuation at once."""
    from lm_eval.api.instance import Instance

    tok = ByteTokenizer()
    lm = GPNScaleLM(model=byte_model, tok=tok, device="cpu", batch_size=2)
    pairs = [("the cat", " sat"), ("the cat", " ran"), ("", "hello"), ("dogs ", "bark")]
    reqs = [Instance("loglikelihood", {}, p, i, metadata=("t", i, 1)) for i, p in enumerate(pairs)]
    got = lm.loglikelihood(reqs)
    for (ctx, cont), (total, _) in zip(pairs, got):
        c, w = lm._encode_pair(ctx, cont)
        with torch.no_grad():
            logits = byte_model(torch.tensor([c + w]), return_logits=True).logits
        logp = torch.log_softmax(logits.double(), -1)[0, len(c) :]
        want = float(logp.gather(-1, torch.tensor(w)[:, None]).sum())
        assert total == pytest.approx(want, rel=1e-5, abs=1e-5)
