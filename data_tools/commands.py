"""`gpn-scale data …` and `gpn-data …`: the same sub-commands, registered here.

Heavy imports (numpy, tokenizers, streaming, boto3) happen inside the command functions
so that `--help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpn_scale.data.errors import DataError


def _add_build(sub: Any, name: str, help_text: str) -> None:
    p = sub.add_parser(
        name,
        help=help_text,
        description=help_text.capitalize()
        + "."
        + (
            " Documents are tokenised with an end-of-document token after each, packed into "
            "non-overlapping windows of --seq-len tokens, shuffled by --seed, and the last bin "
            "is held out as the val split. Output: OUT/train/, OUT/val/ (MDS, zstd, sha1+xxh64 "
            "shard hashes) and OUT/gpn_dataset.json. OUT is a directory or s3://bucket/prefix "
            "(credentials from boto3, endpoint from S3_ENDPOINT_URL)."
        ),
    )
    _add_build_sources(p)
    _add_build_windows(p)
    _add_build_run(p)
    p.set_defaults(func=cmd_build)


def _add_build_sources(p: argparse.ArgumentParser) -> None:
    """`build`'s inputs, their format and where the dataset goes."""
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text/JSONL/Parquet files or directories; hf:NAME[:CONFIG] for a "
        "Hugging Face dataset (needs internet and `datasets`); with --format megatron a "
        "Megatron .bin/.idx PREFIX or a folder of them",
    )
    p.add_argument("--out", "-o", required=True, help="dataset root: directory or s3://...")
    p.add_argument(
        "--format",
        default="auto",
        choices=("auto", "text", "jsonl", "parquet", "hf", "megatron"),
        help="input format (default: from the file extension); megatron: an already "
        "tokenised Megatron indexed dataset, read with megatron-core (--tokenizer must be "
        "the one it was made with)",
    )
    p.add_argument(
        "--megatron-eod",
        default="auto",
        choices=("auto", "append", "none"),
        help="--format megatron: the end-of-document id after each document: auto = "
        "appended where a document does not already end with it (default), append = always, "
        "none = never",
    )
    p.add_argument(
        "--field",
        default="text",
        help="JSONL field / Parquet column / HF column with the text (default: text)",
    )
    p.add_argument(
        "--hf-split", default="train", help="split of a Hugging Face dataset (default: train)"
    )


def _add_build_windows(p: argparse.ArgumentParser) -> None:
    """`build`'s tokens and windows: tokenizer, end-of-document, window length, val split."""
    p.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (built-in, vocab 257), a tokenizer.json or its directory, or "
        "a Hugging Face Hub name (default: byte)",
    )
    p.add_argument(
        "--eod-token",
        default=None,
        help="end-of-document token (default: first of <|endoftext|>, </s>, ...)",
    )
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--seed", type=int, default=0, help="window shuffle seed (default 0)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.01,
        help="fraction of windows held out as val (default 0.01)",
    )
    p.add_argument(
        "--val-windows",
        type=int,
        default=None,
        help="hold out exactly this many windows (overrides --val-fraction)",
    )


def _add_build_run(p: argparse.ArgumentParser) -> None:
    """How `build` runs: processes, shard size, limits, scratch space, overwrite, progress."""
    p.add_argument("--workers", type=int, default=1, help="tokeniser processes (default 1)")
    p.add_argument("--shard-size", default="64mb", help="raw bytes per shard (default 64mb)")
    p.add_argument(
        "--max-docs", type=int, default=None, help="stop after this many documents (default: all)"
    )
    _add_encoding_errors(p)
    p.add_argument(
        "--scratch-dir",
        default=None,
        help="where the token scratch file goes (needs ~2 bytes/token)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a dataset already at --out (never done otherwise)",
    )
    p.add_argument(
        "--quiet", "-q", action="store_true", help="no progress bars (none off a terminal either)"
    )


def register(subparsers: Any) -> None:
    """Add the `data` command (with its sub-commands) to the `gpn-scale` CLI."""
    data = subparsers.add_parser(
        "data",
        help="build, inspect and verify MDS token datasets (local or s3://)",
        description="Text -> tokens -> packed windows -> MDS shards (+ metadata, verify). "
        "Exit status: 0 done, 2 bad input or bad data (one line on stderr).",
    )
    add_data_commands(data)


def add_data_commands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
    _add_build(sub, "build", "tokenise text and write a train/val MDS dataset")
    _add_build(sub, "tokenize", "same as `build`")
    _add_train_tokenizer(sub)
    _add_inspect(sub)
    _add_verify(sub)
    _add_default_corpus(sub)


def _add_train_tokenizer(sub: Any) -> None:
    p = sub.add_parser(
        "train-tokenizer",
        help="train a byte-level BPE tokenizer on a corpus",
        description="Train a byte-level BPE tokenizer (Hugging Face `tokenizers`)"
        " on the inputs and save tokenizer.json for `build "
        "--tokenizer`.",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text/JSONL/Parquet files or directories; hf:NAME[:CONFIG] for a "
        "Hugging Face dataset (as for `build`)",
    )
    p.add_argument(
        "--out", "-o", required=True, help="tokenizer.json path (or a directory to put it in)"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        help="vocabulary size, special tokens included (required)",
    )
    p.add_argument(
        "--eod-token",
        default="<|endoftext|>",
        help="end-of-document special token (default: <|endoftext|>)",
    )
    p.add_argument(
        "--min-frequency",
        type=int,
        default=2,
        help="merges need a pair seen at least this often (default 2)",
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=("auto", "text", "jsonl", "parquet", "hf"),
        help="input format (default: from the file extension)",
    )
    p.add_argument(
        "--field",
        default="text",
        help="JSONL field / Parquet column / HF column with the text (default: text)",
    )
    p.add_argument(
        "--hf-split", default="train", help="split of a Hugging Face dataset (default: train)"
    )
    p.add_argument(
        "--max-docs",
        type=int,
        default=None,
        help="train on the first this many documents (default: all)",
    )
    _add_encoding_errors(p)
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_tokenizer)


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="print a dataset's metadata",
        description="Print the metadata stored beside the index (tokenizer, "
        "vocab size, seq_len, token counts per split, source, seed).",
    )
    p.add_argument("root", help="dataset root: directory or s3://bucket/prefix")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.set_defaults(func=cmd_inspect)


def _add_verify(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="re-hash every shard; report bad ones by name",
        description="Download every shard, check size and hashes against the "
        "split's index.json and the sample counts against the "
        "metadata. Exit 0 when all is well, 2 otherwise.",
    )
    p.add_argument("root", help="dataset root: directory or s3://bucket/prefix")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_verify)


def _add_default_corpus(sub: Any) -> None:
    p = sub.add_parser(
        "default-corpus",
        help="build the embedded default dataset (no internet needed)",
        description="Build the default dataset from documentation text shipped "
        "with Python (reference topics + stdlib docstrings), "
        "byte-level tokens. Reuses an identical existing build.",
    )
    p.add_argument(
        "--out", "-o", required=True, help="dataset root to write: directory or s3://bucket/prefix"
    )
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window (default 256)")
    p.add_argument("--seed", type=int, default=0, help="window shuffle seed (default 0)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a different dataset already at --out (an identical build "
        "is reused either way)",
    )
    p.add_argument(
        "--print-text", action="store_true", help="print the corpus text instead of building"
    )
    p.set_defaults(func=cmd_default_corpus)


def show_progress(args: argparse.Namespace) -> bool:
    """Progress bars only on a terminal: in a pipe or a log file, tqdm's redraws are noise."""
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


def cmd_build(args: argparse.Namespace) -> int:
    from data_tools.build import BuildOptions, build_dataset, build_from_tokens, check_output
    from data_tools.tokenizer import resolve_tokenizer

    megatron = args.format == "megatron"
    if megatron:
        from data_tools.megatron import expand_prefixes

        prefixes = expand_prefixes(args.inputs)
    else:
        from data_tools.sources import expand_inputs

        files = expand_inputs(args.inputs, args.format)
    spec = resolve_tokenizer(args.tokenizer, args.eod_token)
    check_output(args.out, args.overwrite)  # before reading any input: --out taken/unwritable
    options = BuildOptions(
        seq_len=args.seq_len,
        seed=args.seed,
        val_fraction=args.val_fraction,
        val_windows=args.val_windows,
        workers=args.workers,
        shard_size=args.shard_size,
        overwrite=args.overwrite,
        scratch_dir=args.scratch_dir,
        progress=show_progress(args),
    )
    source: dict[str, Any] = {
        "description": ", ".join(args.inputs)[:500],
        "inputs": list(args.inputs),
        "format": args.format,
    }
    if megatron:
        from data_tools.megatron import write_tokens

        def read_megatron(token_file: str) -> tuple[int, int, dict[str, Any]]:
            counts = write_tokens(
                prefixes,
                token_file,
                dtype=spec.dtype,
                vocab_size=spec.vocab_size,
                eod_id=spec.eod_token_id,
                mode=args.megatron_eod,
                max_docs=args.max_docs,
                progress=options.progress,
            )
            facts = {"megatron": {"eod": args.megatron_eod, **counts}}
            return counts["documents"], counts["tokens"], facts

        meta = build_from_tokens(read_megatron, args.out, spec, options, source)
    else:
        source["field"] = args.field
        meta = build_dataset(_documents(files, args), args.out, spec, options, source)
    print(
        f"wrote {args.out}: train {meta.splits['train'].samples} windows "
        f"({meta.splits['train'].tokens:,} tokens), val {meta.splits['val'].samples} windows "
        f"({meta.splits['val'].tokens:,} tokens), vocab {meta.vocab_size}, seq_len "
        f"{meta.seq_len}"
        + (
            f"; {meta.source['documents']:,} Megatron documents, EOD appended to "
            f"{meta.source['megatron']['eod_appended']:,} (--megatron-eod {args.megatron_eod})"
            if megatron
            else ""
        )
    )
    return 0


def cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from data_tools.sources import expand_inputs
    from data_tools.tokenizer import train_bpe

    files = expand_inputs(args.inputs, args.format)
    docs = _documents(files, args)
    spec = train_bpe(
        docs,
        args.out,
        vocab_size=args.vocab_size,
        eod_token=args.eod_token,
        min_frequency=args.min_frequency,
        show_progress=show_progress(args),
    )
    print(
        f"wrote {spec.name}: vocab {spec.vocab_size}, eod {spec.eod_token!r} = {spec.eod_token_id}"
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from data_tools.verify import describe
    from gpn_scale.data.metadata import read_metadata

    meta = read_metadata(args.root)
    print(meta.to_json().rstrip() if args.json else describe(meta, args.root))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from data_tools.verify import verify_dataset

    report = verify_dataset(args.root, progress=show_progress(args))
    for line in report.bad:
        print(f"BAD  {line}")
    for line in report.problems:
        print(f"PROBLEM  {line}")
    if not report.ok:
        names = ", ".join(b.split(":")[0] for b in report.bad) or "metadata/index"
        raise DataError(
            f"{args.root}: {len(report.bad)} of {report.checked} shards failed "
            f"verification ({names}); rebuild with --overwrite"
        )
    print(f"ok: {report.checked} shards verified in {args.root}")
    return 0


def cmd_default_corpus(args: argparse.Namespace) -> int:
    from data_tools.default_corpus import build_default_dataset, default_corpus_documents

    if args.print_text:
        for doc in default_corpus_documents():
            sys.stdout.write(doc + "\n\n")
        return 0
    root = build_default_dataset(
        args.out,
        seq_len=args.seq_len,
        seed=args.seed,
        overwrite=args.overwrite,
        progress=show_progress(args),
    )
    from gpn_scale.data.metadata import read_metadata

    meta = read_metadata(root)
    print(
        json.dumps(
            {
                "root": root,
                "vocab_size": meta.vocab_size,
                "seq_len": meta.seq_len,
                "train_tokens": meta.tokens("train"),
                "val_tokens": meta.tokens("val"),
            }
        )
    )
    return 0


def _add_encoding_errors(p: argparse.ArgumentParser) -> None:
    """--encoding-errors, for every command that reads text inputs (build, train-tokenizer)."""
    p.add_argument(
        "--encoding-errors",
        default="strict",
        choices=("strict", "replace"),
        help="text and JSONL inputs must be UTF-8: strict (default) refuses a byte that is "
        "not, naming the file and its offset; replace reads such bytes as U+FFFD",
    )


def _documents(files: list, args: argparse.Namespace) -> Any:
    """The documents of `files` as build and train-tokenizer read them (their shared flags)."""
    from data_tools.sources import iter_documents

    return iter_documents(
        files,
        field=args.field,
        hf_split=args.hf_split,
        max_docs=args.max_docs,
        encoding_errors=args.encoding_errors,
    )
