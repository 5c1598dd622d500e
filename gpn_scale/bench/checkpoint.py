"""How long a checkpoint save blocks training: checkpoint.async_mode off vs async.

    python -m gpn_scale.bench.checkpoint [--models tiny,transformer_pp_130m] [--rounds 3]

For each model (any registered family's config, models/registry.py): the model and an
AdamW state (its moments filled by one step) saved into a local checkpoint root in a
temporary directory, as the trainer saves them (CheckpointManager, DCP, manifest, `latest`):
  sync blocking      the whole `save` (write, hash, upload, commit): what training waits
                     for with async_mode=off
  async blocking     `AsyncSaver.save` until it returns (the copy of the state to CPU, the
                     save's start): what training waits for with async_mode=async
  async background   the rest (write, hash, upload, commit in the background thread),
                     measured by waiting for it at once
Best of `--rounds` (on a shared machine the best round is the least disturbed one); one
process, the threads torch is given (`--threads`). Printed, never asserted.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def _state(name: str) -> tuple[dict, int]:
    """The app_state the trainer's PlainTrainModule saves, and the parameter count."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from gpn_scale.models.registry import family_of, load_model_config
    from gpn_scale.optim import build_adamw

    _, cfg = load_model_config(name)
    torch.manual_seed(0)
    model = family_of(cfg).build(cfg)
    opt = build_adamw(model, 1e-3, (0.9, 0.95), 1e-8, 0.1)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()  # the moments exist, as after any training step
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}, sum(p.numel() for p in model.parameters())


def _measure(name: str, rounds: int, root: Path) -> dict[str, float]:
    from gpn_scale.checkpoint import CheckpointManager
    from gpn_scale.checkpoint.async_save import AsyncSaver

    state, n_params = _state(name)
    nbytes = sum(t.numel() * t.element_size() for part in state.values() for t in _tensors(part))
    mgr = CheckpointManager(str(root / name), keep_last=1)
    saver = AsyncSaver(mgr, "async", lambda _: None)
    meta = {"bench": name}
    sync, blocking, background = [], [], []
    step = 0
    for _ in range(rounds):
        step += 1
        t0 = time.perf_counter()
        mgr.save(step, state, meta=meta, rank_state={"r": 0})
        sync.append(time.perf_counter() - t0)
        step += 1
        t0 = time.perf_counter()
        saver.save(step, state, meta=meta, rank_state={"r": 0}, files=None)
        t1 = time.perf_counter()
        saver.wait()
        blocking.append(t1 - t0)
        background.append(time.perf_counter() - t1)
    saver.close()
    return {
        "params": float(n_params),
        "state_mb": nbytes / 2**20,
        "sync": min(sync),
        "async": min(blocking),
        "background": min(background),
    }


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,transformer_pp_130m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"checkpoint save, blocking part (best of {args.rounds}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, local root in the temp dir)"
    )
    print(
        f"{'model':<24} {'params':>12} {'state MB':>9} {'sync blocking':>14} "
        f"{'async blocking':>15} {'async background':>17}"
    )
    with tempfile.TemporaryDirectory(prefix="gpn_bench_ckpt_") as tmp:
        for name in args.models.split(","):
            r = _measure(name.strip(), args.rounds, Path(tmp))
            print(
                f"{name:<24} {int(r['params']):>12,} {r['state_mb']:>9.1f} "
                f"{r['sync']:>13.3f}s {r['async']:>14.3f}s {r['background']:>16.3f}s"
            )


if __name__ == "__main__":
    main()
