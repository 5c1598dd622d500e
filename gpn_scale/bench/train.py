"""Trainer overhead: tokens/s of `gpn-scale train` vs the bare engine, side by side.

    python -m gpn_scale.bench.train [--config small] [--model NAME] [--steps 12] [--threads N]

`--model` swaps the training config's model for any registered family's config
(models/registry.py; e.g. transformer_pp_10m): the "engine" rows are then that family's bare
forward + backward (+ AdamW) loop, built by its FamilySpec, against the same trainer.

Rows (same model, batch, sequence length, thread count, one process):
  engine step            forward + backward + AdamW on a fixed batch: the training step that
                         the engine benchmark (`python -m gpn_scale.bench.engine`, "speed")
                         times, measured here in the same process so both rows see the same
                         machine load. The reference row (100%).
  engine fwd+bwd         the same without the optimizer (for scale)
  gpn-scale train        the real Trainer (data loader, param groups, grad-norm + clip,
                         non-finite checks, LR schedule, metrics.jsonl every step), tokens/s
                         from its own step timer
The ratio gpn-scale train / engine step is the figure in docs/perf.md "Trainer overhead"
(target >= 90%).
Medians over the measured steps (the first steps are warm-up), best of `--rounds`
interleaved rounds (on a shared machine the best round is the least disturbed one);
printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpn_scale.io.run_folder import METRICS


def _engine_tokens_per_s(
    model_cfg, batch: int, seq_len: int, steps: int, with_optim: bool, warmup: int = 2
) -> float:
    from gpn_scale.models.registry import family_of
    from gpn_scale.optim import build_adamw

    torch.manual_seed(0)
    model = family_of(model_cfg).build(model_cfg)
    opt = build_adamw(model, 1e-3, (0.9, 0.95), 1e-8, 0.1) if with_optim else None
    tokens = torch.randint(0, model_cfg.vocab_size, (batch, seq_len))
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = model(tokens).loss
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return batch * seq_len / statistics.median(times)


def _trainer_tokens_per_s(
    config: str, steps: int, run_dir: Path, warmup: int = 2, extra: list[str] | None = None
) -> tuple[float, dict[str, float]]:
    from gpn_scale.app.assemble import step_callbacks
    from gpn_scale.run.config import load_train_config
    from gpn_scale.train.loop import Trainer

    cfg = load_train_config(
        config,
        [
            f"run_dir={run_dir}",
            f"schedule.total_steps={warmup + steps}",
            "schedule.warmup_steps=1",
            "eval.at_end=false",
            "checkpoint.save_final=false",
            "checkpoint.every_steps=0",
            "train.progress_bar=false",
            "logging.wandb.mode=disabled",
            *(extra or []),
        ],
    )
    Trainer(cfg, log=lambda _msg: None, callbacks=step_callbacks(cfg)).run()
    rows = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_s" in r and r["step"] > warmup]
    # Means (not medians) so that the parts add up to the whole step.
    parts = {
        k: statistics.fmean(r[k] for r in rows)
        for k in ("step_time_s", "time/data_s", "time/model_s", "time/update_s", "time/optim_s")
        if rows and k in rows[0]
    }
    return statistics.median(r["tokens_per_s"] for r in rows), parts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small", help="training config (default small)")
    p.add_argument(
        "--model", default=None, help="model config of any family (default: the config's)"
    )
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; best is reported")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from gpn_scale.models.registry import load_model_config
    from gpn_scale.run.config import batch_layout, load_train_config

    model_arg = [f"model={args.model}"] if args.model else []
    cfg = load_train_config(args.config, model_arg)
    _, model_cfg = load_model_config(cfg.model, overrides=cfg.model_overrides or None)
    micro, accum = batch_layout(cfg, 1)
    batch, seq = micro * accum, cfg.data.seq_len
    with tempfile.TemporaryDirectory() as tmp:
        # Build the data first so that its one-off cost is not in anyone's timing.
        run_dir = Path(tmp) / "run"
        _trainer_tokens_per_s(args.config, 1, run_dir, warmup=0, extra=model_arg)  # the corpus
        data = [
            "data.remote=" + str(next((run_dir / "data").glob("default_corpus_T*"))),
            *model_arg,
        ]
        engs, eng_opts, trainers = [], [], []
        for r in range(args.rounds):
            engs.append(_engine_tokens_per_s(model_cfg, batch, seq, args.steps, with_optim=False))
            eng_opts.append(
                _engine_tokens_per_s(model_cfg, batch, seq, args.steps, with_optim=True)
            )
            trainers.append(
                _trainer_tokens_per_s(args.config, args.steps, Path(tmp) / f"run{r}", extra=data)
            )
    best = max(trainers, key=lambda t: t[0])
    trainer_rates = [t[0] for t in trainers]
    fwd_bwd, engine, trainer = max(engs), max(eng_opts), max(trainer_rates)
    print(
        f"\nTrainer overhead: {args.config} ({model_cfg.name}, batch {batch} x {seq} tokens, "
        f"{torch.get_num_threads()} threads, {args.steps} measured steps, medians)\n"
    )
    print(f"| {'path':<27} | {'tokens/s':>10} | {'vs engine':>9} |")
    print(f"|{'-' * 29}|{'-' * 12}|{'-' * 11}|")
    for name, value in (
        ("engine step (fwd+bwd+AdamW)", engine),
        ("engine fwd+bwd", fwd_bwd),
        ("gpn-scale train", trainer),
    ):
        print(f"| {name:<27} | {value:>10.0f} | {value / engine:>8.1%} |")
    print(
        f"\nper round: engine step {[round(x) for x in eng_opts]}, fwd+bwd "
        f"{[round(x) for x in engs]}, trainer {[round(x) for x in trainer_rates]} tokens/s"
    )
    parts = best[1]
    if parts:
        # Within the trainer's own steps (same load for every part): the engine's share of the
        # step is what the trainer's speed is, relative to the engine running alone.
        total = parts["step_time_s"]
        engine_part = parts["time/model_s"] + parts["time/optim_s"]
        clip = parts["time/update_s"] - parts["time/optim_s"]
        print("\nWhere the trainer's step goes (best round, mean over the measured steps):\n")
        print(f"| {'part':<40} | {'ms/step':>9} | {'share':>6} |")
        print(f"|{'-' * 42}|{'-' * 11}|{'-' * 8}|")
        for name, value in (
            ("batch from the loader", parts["time/data_s"]),
            ("forward + backward (engine)", parts["time/model_s"]),
            ("grad norm + clip + finite checks", clip),
            ("AdamW step (engine)", parts["time/optim_s"]),
            ("whole step", total),
        ):
            print(f"| {name:<40} | {value * 1e3:>9.1f} | {value / total:>6.1%} |")
        print(
            f"\nengine share of the trainer's step: {engine_part / total:.1%} "
            "(= trainer tokens/s as a fraction of the engine's at the same load)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
