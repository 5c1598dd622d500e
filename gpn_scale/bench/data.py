"""Data pipeline throughput: `python -m gpn_scale.bench.data`.

1. Tokenisation: documents/s and tokens/s of the built-in byte tokenizer and of a
   byte-level BPE trained on the same corpus (1 and N worker processes).
2. Training loader: tokens/s delivered to the training loop by `build_loader`, reading
   from a local S3 endpoint (moto in its own process, real HTTP): cold cache (every shard
   downloaded, hash-checked, decompressed) and warm cache (shards already local).

The corpus is the embedded default corpus (Python's documentation text), so the numbers
are reproducible offline. Figures go to docs/perf.md ("## Data loader").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

TARGET_TOKENS_PER_S = 500_000  # 100x the <= 5,000 tokens/s the SMALL model consumes


def _tokenise_rates(
    docs: list[str], workdir: str, workers: int, bpe_vocab: int
) -> list[dict[str, Any]]:
    from data_tools.build import start_pool, tokenize_to_file
    from data_tools.tokenizer import encode_in_worker, resolve_tokenizer, train_bpe

    rows = []
    t0 = time.perf_counter()
    bpe = train_bpe(
        docs, os.path.join(workdir, "bpe.json"), vocab_size=bpe_vocab, show_progress=False
    )
    train_s = time.perf_counter() - t0
    n_bytes = sum(len(d.encode()) for d in docs)
    for spec, label in ((resolve_tokenizer("byte"), "byte"), (bpe, f"bpe-{bpe_vocab}")):
        for n_workers in sorted({1, workers}):
            pool, start_s = None, 0.0
            if n_workers > 1:  # time the pool's start apart from the steady state
                start = time.perf_counter()
                pool = start_pool(spec, n_workers)
                pool.map(encode_in_worker, [["warm up"]] * n_workers)
                start_s = time.perf_counter() - start
            start = time.perf_counter()
            n_docs, n_tokens = tokenize_to_file(
                docs,
                spec,
                os.path.join(workdir, "t.bin"),
                workers=n_workers,
                docs_per_task=128,
                progress=False,
                pool=pool,
            )
            seconds = time.perf_counter() - start
            if pool is not None:
                pool.terminate()
            rows.append(
                {
                    "tokenizer": label,
                    "workers": n_workers,
                    "documents": n_docs,
                    "tokens": n_tokens,
                    "seconds": round(seconds, 3),
                    "pool_start_s": round(start_s, 2),
                    "tokens_per_s": round(n_tokens / seconds),
                    "mb_per_s": round(n_bytes / seconds / 1e6, 2),
                }
            )
    rows.append({"tokenizer": f"bpe-{bpe_vocab} training", "seconds": round(train_s, 2)})
    return rows


def _epoch_rate(loader: Any) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = 0
    for batch in loader:
        tokens += batch.numel()
    return tokens, time.perf_counter() - start


def _loader_rates(
    root: str, workdir: str, batch_size: int, num_workers: int, warm_epochs: int
) -> dict[str, Any]:
    from gpn_scale.data import DataConfig, build_loader

    cfg = DataConfig(
        remote=root,
        local_cache=os.path.join(workdir, f"cache-w{num_workers}"),
        num_workers=num_workers,
    )
    loader = build_loader(cfg, "train", batch_size, 0, 1)
    cold_tokens, cold_s = _epoch_rate(loader)
    warm = [_epoch_rate(loader) for _ in range(warm_epochs)]
    warm_rates = [t / s for t, s in warm]
    return {
        "num_workers": num_workers,
        "batch_size": batch_size,
        "seq_len": loader.seq_len,
        "tokens_per_epoch": cold_tokens,
        "cold_tokens_per_s": round(cold_tokens / cold_s),
        "warm_tokens_per_s": round(statistics.median(warm_rates)),
        "warm_epochs": warm_epochs,
    }


def _measure(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """Tokenisation and loader rates, everything written under `workdir`."""
    from data_tools.build import BuildOptions, build_dataset
    from data_tools.default_corpus import default_corpus_documents
    from data_tools.tokenizer import resolve_tokenizer
    from gpn_scale.testing.s3 import LocalS3

    docs = default_corpus_documents(args.max_bytes)
    result: dict[str, Any] = {
        "corpus_bytes": sum(len(d.encode()) for d in docs),
        "documents": len(docs),
    }
    result["tokenisation"] = _tokenise_rates(docs, workdir, args.workers, args.bpe_vocab)

    with LocalS3(process=True) as s3:
        os.environ.update(s3.env())
        bucket = s3.create_bucket("bench")
        root = f"{bucket}/default-{args.seq_len}"
        build_dataset(
            docs,
            root,
            resolve_tokenizer("byte"),
            BuildOptions(seq_len=args.seq_len, val_fraction=0.02, progress=False, shard_size="4mb"),
            {"description": "bench: default corpus"},
        )
        result["loader"] = [
            _loader_rates(root, workdir, args.batch_size, w, args.warm_epochs)
            for w in sorted({0, args.workers})
        ]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpn_scale.bench.data", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument(
        "--workers", type=int, default=2, help="tokeniser processes and loader workers to also try"
    )
    parser.add_argument("--warm-epochs", type=int, default=3)
    parser.add_argument("--bpe-vocab", type=int, default=8192)
    parser.add_argument("--max-bytes", type=int, default=3_000_000, help="corpus size")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)

    workdir = tempfile.mkdtemp(prefix="gpn-bench-data-")
    os.environ["TMPDIR"] = workdir  # streaming's filelocks: private to this run
    tempfile.tempdir = workdir
    try:
        result = _measure(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # the corpus, tokenizers and shards: ~8 MB
    best_warm = max(r["warm_tokens_per_s"] for r in result["loader"])
    result["target_tokens_per_s"] = TARGET_TOKENS_PER_S
    result["meets_target"] = best_warm >= TARGET_TOKENS_PER_S

    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"corpus: embedded default, {result['corpus_bytes']:,} bytes, "
        f"{result['documents']} documents; cpus={os.cpu_count()}"
    )
    print("\ntokenisation")
    print(f"  {'tokenizer':<16}{'workers':>8}{'tokens/s':>14}{'MB/s':>8}{'pool start s':>14}")
    for row in result["tokenisation"]:
        if "tokens_per_s" in row:
            print(
                f"  {row['tokenizer']:<16}{row['workers']:>8}{row['tokens_per_s']:>14,}"
                f"{row['mb_per_s']:>8}{row['pool_start_s']:>14}"
            )
        else:
            print(f"  {row['tokenizer']}: {row['seconds']} s")
    print(f"\ntraining loader from local S3 (seq_len {args.seq_len}, batch {args.batch_size})")
    print(f"  {'loader workers':<16}{'cold tokens/s':>16}{'warm tokens/s':>16}")
    for row in result["loader"]:
        print(
            f"  {row['num_workers']:<16}{row['cold_tokens_per_s']:>16,}"
            f"{row['warm_tokens_per_s']:>16,}"
        )
    print(
        f"\ntarget (warm) >= {TARGET_TOKENS_PER_S:,} tokens/s: "
        f"{'met' if result['meets_target'] else 'NOT met'} ({best_warm:,})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
