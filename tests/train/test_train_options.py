"""In-process runs of the single-process path: gradient accumulation equals the full batch,
stateful windows and truncated BPTT run, and `gpn-scale eval` reproduces the final eval."""

from __future__ import annotations

import json

import pytest
from train_helpers import grad_norms, initial_weights, train_args, train_losses, weight_distance

from gpn_scale.cli import main

ARGS = ("schedule.total_steps=3", "schedule.warmup_steps=1", "checkpoint.every_steps=0")


def test_gradient_accumulation_equals_full_batch(corpus, tmp_path):
    full, acc = tmp_path / "full", tmp_path / "acc"
    assert main(train_args(corpus, full, *ARGS, "checkpoint.export_final=true")) == 0
    assert (
        main(
            train_args(
                corpus, acc, *ARGS, "train.micro_batch_size=1", "checkpoint.export_final=true"
            )
        )
        == 0
    )
    a, b = train_losses(full), train_losses(acc)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for s in a:
        assert b[s] == pytest.approx(a[s], rel=2e-6)
    ga, gb = grad_norms(full), grad_norms(acc)  # catches a wrong 1/accum (Adam would not)
    for s in ga:
        assert gb[s] == pytest.approx(ga[s], rel=1e-5)
    import torch

    wa, wb = torch.load(full / "model_final.pt"), torch.load(acc / "model_final.pt")
    rel, worst = weight_distance(wa, wb, initial_weights())
    assert rel < 1e-4 and worst < 1e-4, (rel, worst)


def test_stateful_windows_and_tbptt_run(corpus, tmp_path):
    run = tmp_path / "run"
    assert (
        main(
            train_args(
                corpus,
                run,
                *ARGS,
                "train.stateful_windows=true",
                "train.tbptt=16",
                "eval.at_end=false",
            )
        )
        == 0
    )
    losses = train_losses(run)
    assert sorted(losses) == [1, 2, 3] and all(isinstance(v, float) for v in losses.values())
    assert "tbptt: 16" in (run / "config.yaml").read_text()


def test_eval_command_reproduces_final_eval(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(train_args(corpus, run, *ARGS)) == 0
    done = json.loads((run / "checkpoints" / "DONE").read_text())
    capsys.readouterr()
    args = train_args(corpus, run)
    args[0] = "eval"
    assert main(args + ["--checkpoint", "auto"]) == 0
    out = capsys.readouterr().out
    assert f"eval: loss {done['final_eval_loss']:.4f}" in out


def test_data_local_cache_holds_the_shard_copies(corpus, tmp_path):
    """data.local_cache is where the loaders copy shards (train.sbatch points it at each node's
    scratch; two nodes sharing the run folder's cache race on the same shard files)."""
    run, cache = tmp_path / "run", tmp_path / "node-scratch" / "cache"
    assert (
        main(
            train_args(
                corpus,
                run,
                *ARGS,
                f"data.local_cache={cache}",
            )
        )
        == 0
    )
    copied = sorted(p.relative_to(cache).parts[0] for p in cache.rglob("shard.*"))
    assert copied and set(copied) == {"train", "val"}, copied
    assert not (run / "data" / "cache").exists()
