"""The device check: one script for a session that is lent a GPU (results under --out).

    python -m gpn_scale.bench.gpu --out "$OUT"              # on the GPU machine (~5 min)
    python -m gpn_scale.bench.gpu --device cpu --config tiny --seq-len 64 \\
        --batches 2,4 --steps 2 --out /tmp/gpu-smoke          # the same code, as a smoke test

1. Exactness on the device: the engine against the step-by-step reference path on a tiny
   config (loss and every gradient) in float64 and float32, and one bf16-autocast step
   (finite loss; state and memory stay float32).
2. Throughput: `--config` (default the paper's 130M 1-layer GPN+M) at `--seq-len` (2048),
   bf16 autocast with float32 state and memory, AdamW; every batch size in `--batches` in
   turn until one does not fit; for each: tokens/s, MFU (against the device's dense bf16
   peak; none on CPU), peak memory.

Writes results.json and results.md to --out and prints the table. Nothing is asserted
here; the exactness tolerances are those of tests/model/test_engine.py and the verdict is
printed next to each error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from gpn_scale.model import GPN, GPNConfig, load_model_config
from gpn_scale.model.counts import count_parameters, flops_per_token
from gpn_scale.model.reference import reference_forward
from gpn_scale.ops.step_kernels import kernels_for
from gpn_scale.testing.models import perturbed_model, tiny_config
from gpn_scale.train.hardware import device_peak_flops as peak_flops

TINY = tiny_config(n_layers=2)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}


def check_exactness(device: torch.device) -> list[dict]:
    rows = []
    tokens = torch.randint(0, TINY.vocab_size, (3, 12), generator=torch.Generator().manual_seed(3))
    tokens = tokens.to(device)
    for dtype in (torch.float64, torch.float32):
        model = perturbed_model(TINY, dtype).to(device)
        params = list(model.parameters())
        out = model(tokens)
        ref = reference_forward(model, tokens)
        g_out = torch.autograd.grad(out.loss, params)
        g_ref = torch.autograd.grad(ref.loss, params)
        loss_err = ((out.loss - ref.loss).abs() / ref.loss.abs()).item()
        grad_err = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                       for a, b in zip(g_out, g_ref))
        tol = TOLERANCE[dtype]
        rows.append(dict(check=f"engine == reference, {str(dtype).replace('torch.', '')}",
                         loss_rel_err=loss_err, grad_rel_err=grad_err, tolerance=tol,
                         ok=loss_err <= tol and grad_err <= tol))
    model = perturbed_model(TINY, torch.float32).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(tokens, return_state=True)
    out.loss.backward()
    finite = bool(torch.isfinite(out.loss)) and all(torch.isfinite(p.grad).all()
                                                    for p in model.parameters())
    fp32 = out.state.s.dtype == torch.float32 and out.state.memory.dtype == torch.float32
    rows.append(dict(check="bf16 autocast step", loss=out.loss.item(), finite=finite,
                     state_and_memory_fp32=fp32, ok=finite and fp32))
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_throughput(cfg: GPNConfig, batch: int, seq_len: int, device: torch.device,
                       steps: int, warmup: int, bf16: bool) -> dict:
    torch.manual_seed(0)
    model = GPN(cfg).to(device)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(tokens).loss
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    seconds = (time.perf_counter() - start) / steps
    tokens_per_s = batch * seq_len / seconds
    peak = peak_flops(device)
    return dict(batch=batch, seq_len=seq_len, step_s=seconds, tokens_per_s=tokens_per_s,
                mfu=flops_per_token(cfg) * tokens_per_s / peak if peak else None,
                peak_memory_gb=(torch.cuda.max_memory_allocated(device) / 2**30
                                if device.type == "cuda" else None))


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def sweep_batches(cfg: GPNConfig, batches: list[int], seq_len: int, device: torch.device,
                  steps: int, warmup: int, bf16: bool, max_seconds: float) -> list[dict]:
    """Every batch size in turn until one does not fit (or the time budget is spent)."""
    rows: list[dict] = []
    start = time.perf_counter()
    for batch in sorted(batches):
        if time.perf_counter() - start > max_seconds:
            rows.append(dict(batch=batch, skipped="time budget spent"))
            break
        try:
            rows.append(measure_throughput(cfg, batch, seq_len, device, steps, warmup, bf16))
        except Exception as exc:   # OOM ends the search; anything else is a real failure
            if not _is_oom(exc):
                raise
            rows.append(dict(batch=batch, oom=True))
            break
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"  batch {batch}: {rows[-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    return rows


def _markdown(meta: dict, checks: list[dict], runs: list[dict]) -> str:
    lines = [f"# Device check: {meta['device_name']}", "",
             f"torch {meta['torch']}, {meta['config']} ({meta['params']:,} parameters), "
             f"T={meta['seq_len']}, {'bf16 autocast' if meta['bf16'] else 'fp32'}, "
             f"step kernels: {meta['step_form']}", "",
             "| check | result | ok |", "|---|---|---|"]
    for c in checks:
        detail = {k: v for k, v in c.items() if k not in ("check", "ok")}
        lines.append(f"| {c['check']} | {detail} | {'yes' if c['ok'] else '**NO**'} |")
    lines += ["", "| batch | tokens/s | MFU | peak memory GB | step s |", "|---|---|---|---|---|"]
    for r in runs:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['batch']} | {'out of memory' if r.get('oom') else r.get('skipped')}"
                         " | | | |")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] is not None else "-"
        lines.append(f"| {r['batch']} | {r['tokens_per_s']:,.0f} | {mfu} | {mem} | "
                     f"{r['step_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for results.json / results.md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="gpn_m_130m", help="model config name or path")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batches", default="8,16,24,32,48,64,96,128",
                        help="comma-separated batch sizes, tried in increasing order")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per batch size")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    parser.add_argument("--max-seconds", type=float, default=300.0,
                        help="stop trying larger batches after this long")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_model_config(args.config)
    meta = dict(torch=torch.__version__, device=str(device),
                device_name=(torch.cuda.get_device_name(device) if device.type == "cuda"
                             else "CPU"),
                config=args.config, params=count_parameters(cfg), seq_len=args.seq_len,
                bf16=not args.fp32,
                step_form=("fused CPU kernels" if kernels_for(device) is not None
                           else "PyTorch ops"))
    print(f"device check on {meta['device_name']} ({meta['torch']})", flush=True)
    checks = check_exactness(device)
    for c in checks:
        print(f"  {c['check']}: {'ok' if c['ok'] else 'FAILED'} {c}", flush=True)
    runs = sweep_batches(cfg, [int(b) for b in args.batches.split(",")], args.seq_len, device,
                         args.steps, args.warmup, not args.fp32, args.max_seconds)
    (out / "results.json").write_text(json.dumps(dict(meta=meta, checks=checks, runs=runs),
                                                 indent=2))
    report = _markdown(meta, checks, runs)
    (out / "results.md").write_text(report)
    print(report)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
