"""`gpn-scale analyze CHECKPOINT --data ... --out DIR`: the paper's state analyses.

Parsing and plumbing only (torch is imported inside the handler); the analyses are in
stream.py and its accumulators, the outputs in report.py. Exit codes: 0 done, 2 bad input
(one line on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from gpn_scale.data.tokenizer import TOKENIZER_FILE
from gpn_scale.io.outputs import check_out_dir
from gpn_scale.run.sources import describe_tokenizer, same_tokenizer


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="state analyses of a GPN / GPN+M checkpoint (geometry, mean direction, horizons)",
        description="Stream held-out windows through a GPN / GPN+M checkpoint and write "
        "report.md, analysis.json and PNG plots into --out: state geometry, the mean "
        "direction, the state horizon and the per-head memory horizon (docs/analysis.md). "
        "Memory stays bounded whatever the number of windows. Exit codes: 0 done, 2 bad "
        "input (one line on stderr).",
    )
    p.add_argument(
        "checkpoint",
        help="a step directory (.../step_NNNNNNNNN), a checkpoint root or a run directory "
        "(the newest complete checkpoint is used)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="dataset root written by `gpn-data build` (default: the one the checkpoint "
        "was trained on, when it is still there)",
    )
    p.add_argument("--out", required=True, help="output directory (must be empty or new)")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.add_argument("--split", default="val", help="held-out split (default: %(default)s)")
    p.add_argument("--windows", type=int, default=64, help="windows to analyse (default: 64)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per batch (default: 8)")
    p.add_argument(
        "--max-lag", type=int, default=256, help="state horizon lags 1..K (default: 256)"
    )
    p.add_argument(
        "--memory-max-lag",
        type=int,
        default=None,
        help="memory horizon lags 1..K (default: the window length - 1)",
    )
    p.add_argument(
        "--fast-lag",
        type=float,
        default=None,
        help="a head is fast when its 1/e lag is at most this many tokens (default: 4)",
    )
    p.add_argument(
        "--no-centered-horizon",
        action="store_true",
        help="skip the mean-removed state horizon (it costs a second pass per batch)",
    )
    p.add_argument(
        "--unigram-tokens",
        type=int,
        default=10_000_000,
        help="training-split tokens counted for the unigram, when the dataset metadata "
        "holds none (default: 10M; 0 = skip the correlation)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default: %(default)s)")
    p.set_defaults(func=cmd_analyze)


def _fail(msg: str) -> int:
    from gpn_scale.io.storage import redact_urls  # no endpoint password in a line

    print(f"gpn-scale: error: {redact_urls(msg)}", file=sys.stderr, flush=True)
    return 2


def _check_args(args: argparse.Namespace) -> str | None:
    for name in ("windows", "batch_size", "max_lag"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1"
    if args.memory_max_lag is not None and args.memory_max_lag < 1:
        return f"--memory-max-lag {args.memory_max_lag}: must be >= 1 (omit it for T - 1)"
    if args.fast_lag is not None and args.fast_lag <= 0:
        return f"--fast-lag {args.fast_lag}: must be > 0 tokens"
    if args.unigram_tokens < 0:
        return f"--unigram-tokens {args.unigram_tokens}: must be >= 0"
    if args.device not in ("auto", "cpu", "cuda"):
        return f"--device {args.device}: expected auto, cpu or cuda"
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file; pass a directory"
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        return f"--out {out} is not empty; pass --overwrite to write into it, or another --out"
    # Before the analyses run (minutes): a read-only file system, a directory without write
    # permission, or a place that refuses new entries (/proc) is found now, not at the end.
    try:
        check_out_dir(args.out, "--out", error=ValueError)
    except ValueError as exc:
        return str(exc)
    return None


def _token_names(tokenizer: dict[str, Any], ids: list[int]) -> list[str] | None:
    """Decoded tokens for display; None when the tokenizer is not at hand."""
    if tokenizer.get("kind") == "byte":
        eod = tokenizer.get("eod_token_id")
        return [
            bytes([i]).decode("utf-8", "backslashreplace")
            if i < 256
            else (str(tokenizer.get("eod_token", "<eod>")) if i == eod else f"<{i}>")
            for i in ids
        ]
    try:
        from tokenizers import Tokenizer

        name = str(tokenizer.get("name"))
        path = Path(name).expanduser()
        if path.is_dir():
            path = path / TOKENIZER_FILE
        tok = Tokenizer.from_file(str(path)) if path.is_file() else Tokenizer.from_pretrained(name)
        return [tok.id_to_token(i) or f"<{i}>" for i in ids]
    except Exception:  # noqa: BLE001 - offline or moved: the ids still stand
        return None


def cmd_analyze(args: argparse.Namespace) -> int:
    problem = _check_args(args)
    if problem:
        return _fail(problem)
    from gpn_scale.core.config import ConfigError
    from gpn_scale.data import DataError

    try:
        return _analyze(args)
    except (ConfigError, DataError) as err:
        return _fail(" ".join(str(err).split()) or type(err).__name__)


def _analyze(args: argparse.Namespace) -> int:
    import resource
    import tempfile

    import torch

    from gpn_scale.data import read_metadata
    from gpn_scale.data.metadata import check_compatible
    from gpn_scale.eval.analysis.report import write_report
    from gpn_scale.eval.load import describe_loaded, load

    if args.device == "cuda" and not torch.cuda.is_available():
        return _fail("--device cuda: no CUDA device is visible; use --device cpu")
    device = torch.device(
        "cuda"
        if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
        else "cpu"
    )
    t0 = time.perf_counter()
    loaded = load(args.checkpoint, device=device, with_tokenizer=False)
    if not loaded.spec.state_analyses:
        return _fail(
            f"{args.checkpoint} is a {loaded.spec.name} checkpoint; the state analyses read "
            "GPN / GPN+M's single recurrent state and memory heads (use `gpn-scale eval` for it)"
        )
    cfg = loaded.config
    remote = args.data or loaded.training_data
    if remote and not args.data and "://" not in remote and not Path(remote).is_dir():
        remote = None  # its run's data is gone
    if not remote:
        return _fail(
            f"{loaded.checkpoint}: its training data is not at hand; pass --data with a dataset "
            "root written by `gpn-data build`"
        )
    meta = read_metadata(remote)
    check_compatible(meta, vocab_size=cfg.vocab_size)
    recorded = loaded.meta.get("tokenizer")
    if isinstance(recorded, dict) and not same_tokenizer(meta.tokenizer, recorded):
        return _fail(
            f"--data {remote} is tokenized with {describe_tokenizer(meta.tokenizer)}, but "
            f"{loaded.checkpoint} was trained with {describe_tokenizer(recorded)}; pass a "
            "dataset built with the checkpoint's tokenizer"
        )
    print(f"analyze: {describe_loaded(loaded)}", file=sys.stderr, flush=True)
    cache = tempfile.mkdtemp(prefix="gpn_analyze_")  # the streamed shards; removed below
    try:
        result, unigram_source = _stream(args, loaded, remote, meta, cache, device)
    finally:
        _remove(cache)

    md = result["mean_direction"]
    md["unigram_source"] = unigram_source
    names = _token_names(meta.tokenizer, md["top_ids"])
    if names is not None:
        md["top_tokens"] = names
    result["source"] = {
        "checkpoint": loaded.checkpoint,
        "step": loaded.meta.get("step"),
        "model": cfg.to_dict(),
        "data": remote,
        "split": args.split,
        "device": device.type,
    }
    result["peak_memory"] = {
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cuda_mib": torch.cuda.max_memory_allocated(device) / 2**20
        if device.type == "cuda"
        else None,
    }
    result["seconds"] = time.perf_counter() - t0
    if result["windows"] < args.windows:
        print(
            f"analyze: the {args.split} split holds {result['windows']} windows "
            f"(asked for {args.windows}); analysed them all",
            file=sys.stderr,
        )
    write_report(result, Path(args.out))
    g = result["geometry"]
    mem = result["memory_horizon"]
    print(
        f"analyze: {result['windows']} windows x {result['window_tokens']} tokens: stable rank "
        f"{g['stable_rank']:.1f}, PR {g['participation_ratio']:.1f}, PCs 90/99% "
        f"{g['pcs_90']}/{g['pcs_99']}, mean direction {100 * md['norm_rel_mean_state_norm']:.0f}%"
        " of |p|, "
        + (
            f"memory: {len(mem['fast_heads'])} fast / {len(mem['slow_heads'])} slow heads"
            if "skipped" not in mem
            else f"memory horizon skipped ({mem['skipped']})"
        )
        + f"; peak RSS {result['peak_memory']['rss_mib']:.0f} MiB; wrote {args.out}/report.md"
    )
    return 0


def _remove(path: str) -> None:
    """Remove the shard cache; streaming's download thread may still be finishing a file."""
    import shutil

    for _ in range(5):
        shutil.rmtree(path, ignore_errors=True)
        if not Path(path).exists():
            return
        time.sleep(0.2)


def _stream(args: argparse.Namespace, loaded: Any, remote: str, meta: Any, cache: str, device):
    """(analysis result, where the unigram came from): the loaders' part of `analyze`."""
    import numpy as np
    import torch

    from gpn_scale.data import DataConfig, build_loader
    from gpn_scale.eval.analysis.memory import DEFAULT_FAST_LAG
    from gpn_scale.eval.analysis.stream import AnalysisOptions, analyze_states

    cfg = loaded.config
    rows_left = args.windows

    def loader(split: str, batch: int):
        return build_loader(
            DataConfig(remote=remote, local_cache=str(Path(cache) / split), shuffle=False),
            split=split,
            batch_size=batch,
            rank=0,
            world_size=1,
            vocab_size=cfg.vocab_size,
        )

    unigram, unigram_source = None, "skipped (--unigram-tokens 0)"
    if isinstance(meta.extra.get("unigram"), list):
        unigram, unigram_source = np.asarray(meta.extra["unigram"]), "dataset metadata"
    elif args.unigram_tokens > 0 and getattr(meta.splits.get("train"), "samples", 0) == 0:
        unigram_source = "skipped (the dataset has no train split to count)"
    elif args.unigram_tokens > 0:
        counts = np.zeros(max(cfg.vocab_size, meta.vocab_size), dtype=np.int64)
        # a batch no larger than the split: the loader drops an incomplete last batch
        seen, train = 0, loader("train", max(1, min(64, meta.splits["train"].samples)))
        try:
            for batch in train:
                flat = batch.reshape(-1).numpy()[: args.unigram_tokens - seen]
                counts += np.bincount(flat, minlength=counts.shape[0])[: counts.shape[0]]
                seen += flat.shape[0]
                if seen >= args.unigram_tokens:
                    break
        finally:
            train.close()
        unigram, unigram_source = counts, "counted over the train split"

    def windows():
        nonlocal rows_left
        held = loader(args.split, args.batch_size)
        try:
            for batch in held:
                if rows_left <= 0:
                    break
                batch = batch[:rows_left]
                rows_left -= batch.shape[0]
                yield batch
        finally:
            held.close()

    options = AnalysisOptions(
        max_lag=args.max_lag,
        memory_max_lag=args.memory_max_lag,
        fast_lag=args.fast_lag if args.fast_lag is not None else DEFAULT_FAST_LAG,
        centered_horizon=not args.no_centered_horizon,
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = analyze_states(loaded.model, windows(), options, device=device, unigram=unigram)
    return result, unigram_source
