"""`gpn-scale demo`: the README's one command, end to end on one CPU.

Builds the embedded default corpus (byte-level tokens), trains a small GPN+M with the
regular trainer (`configs/train/demo.yaml`: same loop, checkpoints and metrics as a cluster
run), evaluates it on held-out windows, and draws the loss curve. Prints where everything is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gpn_scale.io.run_folder import CHECKPOINTS, LOSS_CURVE, METRICS, RUN_CONFIG


def plot_loss_curve(metrics_path: str | Path, out_png: str | Path, title: str = "") -> Path:
    """Train loss per step (and held-out loss points) from metrics.jsonl into a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers / CI
    import matplotlib.pyplot as plt

    train, evals = [], []
    for line in Path(metrics_path).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("train/loss") is not None:
            train.append((rec["step"], rec["train/loss"]))
        if rec.get("eval/loss") is not None:
            evals.append((rec["step"], rec["eval/loss"]))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), lw=1.2, label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", ms=5, label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title or "GPN+M demo")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def run_demo(
    out: str = "runs/demo", steps: int | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> int:
    from gpn_scale.app.assemble import step_callbacks
    from gpn_scale.core.config import ConfigError
    from gpn_scale.run.config import load_train_config
    from gpn_scale.train.loop import Trainer

    if steps is not None and steps < 1:  # 0 is a number given, not "not given"
        raise ConfigError(
            f"--steps {steps}: the demo trains at least 1 step; omit --steps for the demo's "
            f"{load_train_config('demo').schedule.total_steps}"
        )
    run_dir = Path(out)
    extra = [f"run_dir={run_dir}"]
    if steps is not None:  # a shorter demo keeps warmup at ~10% of the run
        base = load_train_config("demo").schedule.warmup_steps
        extra += [
            f"schedule.total_steps={steps}",
            f"schedule.warmup_steps={min(base, max(0, steps // 10))}",
        ]
    cfg = load_train_config("demo", [*extra, *overrides])
    # A demo always starts fresh: drop the previous demo's outputs (the built corpus stays).
    for stale in (METRICS, LOSS_CURVE, RUN_CONFIG):
        (run_dir / stale).unlink(missing_ok=True)
    if cfg.checkpoint.root is None:
        shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)

    result = Trainer(cfg, resume="none", callbacks=step_callbacks(cfg)).run()
    if result.exit_code != 0:
        return result.exit_code
    metrics = run_dir / METRICS
    png = plot_loss_curve(
        metrics,
        run_dir / LOSS_CURVE,
        title=f"GPN+M demo ({cfg.model}, {result.step} steps on CPU)",
    )
    ev = result.final_eval
    print()
    print("demo finished")
    if ev:
        print(
            f"  held-out loss  {ev['eval/loss']:.4f} nats/token (ppl {ev['eval/ppl']:.2f}; "
            f"a uniform byte model would be {__import__('math').log(256):.2f})"
        )
    print(f"  checkpoint     {result.checkpoint}")
    print(f"  metrics        {metrics}")
    print(f"  loss curve     {png}")
    print(f"  config         {run_dir / RUN_CONFIG}")
    print(
        f"  resume/extend  gpn-scale train demo run_dir={run_dir} schedule.total_steps=N "
        "--resume auto"
    )
    return 0
