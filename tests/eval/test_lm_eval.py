"""The lm-evaluation-harness adapter on tiny LOCAL tasks through the harness's own evaluator
(no network: JSONL files read by `datasets`' json builder, task YAMLs in a temp dir)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from fake_lm import V, bigram

lm_eval = pytest.importorskip("lm_eval")

from gpn_scale.eval.lm_eval_adapter import GPNScaleLM  # noqa: E402
from gpn_scale.eval.tokenizer import ByteTokenizer  # noqa: E402

CHOICE_DOCS = [  # after " " the model prefers "c": the answer starting with "c" wins
    {"context": "pick one:", "choices": [" ab", " cd", " ef"], "label": 1},
    {"context": "again:", "choices": [" cx", " zz"], "label": 1},
]
GEN_DOCS = [{"prompt": "a", "answer": "bcd"}, {"prompt": "k", "answer": "lmn"}]
ROLL_DOCS = [{"text": "abc"}, {"text": "hello"}]


def write_tasks(root: Path) -> Path:
    """Three tasks: multiple choice (loglikelihood), generate_until, loglikelihood_rolling."""
    tasks = root / "tasks"
    tasks.mkdir(parents=True)
    cache = root / "hf_cache"
    specs = {
        "gpn_tiny_choice": (
            CHOICE_DOCS,
            "output_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
            "doc_to_choice: '{{choices}}'\ndoc_to_target: label\n"
            "target_delimiter: ''\nmetric_list:\n  - metric: acc\n",
        ),
        "gpn_tiny_gen": (
            GEN_DOCS,
            "output_type: generate_until\ndoc_to_text: '{{prompt}}'\n"
            "doc_to_target: '{{answer}}'\ntarget_delimiter: ''\n"
            "generation_kwargs:\n  until: ['e', 'o']\n  max_gen_toks: 8\n"
            "metric_list:\n  - metric: exact_match\n",
        ),
        "gpn_tiny_roll": (
            ROLL_DOCS,
            "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
            "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
            "  - metric: bits_per_byte\n",
        ),
    }
    for name, (docs, body) in specs.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tasks / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n"
            f"  data_files:\n    test: {data}\n  cache_dir: {cache}\n"
            f"test_split: test\n{body}"
        )
    return tasks


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
