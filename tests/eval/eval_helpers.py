"""Helpers for the eval tests: real checkpoints written by the CheckpointManager (no training
run: a tiny model, saved as the trainer saves it), tiny datasets' metadata naming the byte
tokenizer, and tiny local lm-eval tasks. (A uniquely named module: `conftest` is ambiguous
when several test directories are collected.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gpn_scale.checkpoint import CheckpointManager
from gpn_scale.data.metadata import DatasetMetadata, SplitInfo, write_metadata


def byte_dataset(root: Path) -> str:
    """A dataset root holding only its metadata (the byte tokenizer); enough for eval."""
    meta = DatasetMetadata(
        vocab_size=257,
        seq_len=16,
        tokenizer={"kind": "byte", "name": "byte", "eod_token_id": 256},
        eod_token_id=256,
        splits={"train": SplitInfo(1, 16, 1), "val": SplitInfo(1, 16, 1)},
        source={"description": "test"},
        seed=0,
    )
    root.mkdir(parents=True, exist_ok=True)
    write_metadata(str(root), meta)
    return str(root)


def save_checkpoint(run_dir: Path, model: torch.nn.Module, data: str, step: int = 7) -> str:
    """A DCP checkpoint under run_dir/checkpoints as the trainer writes it (model + meta)."""
    mgr = CheckpointManager(str(run_dir / "checkpoints"))
    meta: dict[str, Any] = {
        "step": step,
        "tokens": step * 16,
        "model_config": model.config.to_dict(),
        "config": {"data": {"remote": data, "seq_len": 16}, "run_dir": str(run_dir)},
    }
    return mgr.save(step, {"model": model.state_dict()}, meta=meta)


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
