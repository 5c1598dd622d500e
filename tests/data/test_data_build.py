"""gpn-data build on local paths: input formats, determinism, --overwrite, tokenizers,
multiprocess tokenisation, verify, and the embedded default corpus."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_helpers import one_line

from data_tools.cli import main as gpn_data
from data_tools.default_corpus import build_default_dataset, default_corpus_documents
from gpn_scale.data import DataError, read_metadata


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture
def mixed_inputs(tmp_path) -> Path:
    src = tmp_path / "inputs"
    src.mkdir()
    (src / "a_notes.txt").write_text("A plain text file is one document. " * 30)
    with open(src / "b_web.jsonl", "w") as fh:
        for i in range(25):
            fh.write(json.dumps({"url": f"u{i}", "text": f"jsonl doc {i} " * 25}) + "\n")
    table = pa.table(
        {
            "text": [f"parquet row {i} " * 25 for i in range(15)],
            "score": [float(i) for i in range(15)],
        }
    )
    pq.write_table(table, src / "c_fineweb.parquet")
    return src


def test_text_jsonl_parquet_build_is_deterministic_and_never_overwrites(
    mixed_inputs, tmp_path, capsys
):
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    argv = [
        str(mixed_inputs),
        "--seq-len",
        "64",
        "--val-fraction",
        "0.1",
        "--shard-size",
        "4kb",
        "-q",
    ]
    assert gpn_data(["build", *argv, "--out", str(out_a)]) == 0
    assert gpn_data(["tokenize", *argv, "--out", str(out_b)]) == 0
    meta = read_metadata(str(out_a))
    assert meta.source["documents"] == 1 + 25 + 15
    n = meta.splits["train"].samples + meta.splits["val"].samples
    assert meta.total_tokens - meta.dropped_tokens == n * 64
    assert meta.splits["val"].samples == round(n * 0.1)
    assert _tree_bytes(out_a) == _tree_bytes(out_b), "same inputs + seed must give same bytes"

    before = _tree_bytes(out_a)
    capsys.readouterr()
    assert gpn_data(["build", *argv, "--out", str(out_a), "--seed", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds a dataset" in err and "--overwrite" in err and "\n" not in err
    assert _tree_bytes(out_a) == before

    assert gpn_data(["build", *argv, "--out", str(out_a), "--seed", "1", "--overwrite"]) == 0
    assert read_metadata(str(out_a)).seed == 1
    assert _tree_bytes(out_a) != before


def test_bad_inputs_give_one_line(tmp_path, capsys, monkeypatch):
    jsonl = tmp_path / "x.jsonl"
    jsonl.write_text(json.dumps({"content": "hi"}) + "\n")
    assert gpn_data(["build", str(jsonl), "--out", str(tmp_path / "o"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no field 'text'" in err and "--field" in err and "\n" not in err
    assert gpn_data(["build", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "datasets", None)  # as on a machine without it
    assert (
        gpn_data(["build", "hf:HuggingFaceFW/fineweb-edu", "--out", str(tmp_path / "o"), "-q"]) == 2
    )
    assert "needs the `datasets` package" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    assert gpn_data(["build", str(short), "--out", str(tmp_path / "o"), "-q"]) == 2
    assert "shorter than one window" in capsys.readouterr().err


@pytest.mark.slow
def test_trained_bpe_tokenizer_and_multiprocess_tokenisation(mixed_inputs, tmp_path, capsys):
    tok = tmp_path / "tok" / "tokenizer.json"
    assert (
        gpn_data(
            ["train-tokenizer", str(mixed_inputs), "--out", str(tok), "--vocab-size", "300", "-q"]
        )
        == 0
    )
    assert tok.is_file()
    common = [
        str(mixed_inputs),
        "--tokenizer",
        str(tok.parent),
        "--seq-len",
        "32",
        "--val-windows",
        "2",
        "-q",
    ]
    assert gpn_data(["build", *common, "--out", str(tmp_path / "w1"), "--workers", "1"]) == 0
    assert gpn_data(["build", *common, "--out", str(tmp_path / "w2"), "--workers", "2"]) == 0
    meta = read_metadata(str(tmp_path / "w1"))
    assert meta.tokenizer["kind"] == "huggingface" and meta.vocab_size == 300
    assert meta.eod_token_id == 0  # <|endoftext|> is the first special token
    assert _tree_bytes(tmp_path / "w1") == _tree_bytes(tmp_path / "w2")


def test_verify_names_a_corrupted_local_shard(mixed_inputs, tmp_path, capsys):
    out = tmp_path / "ds"
    assert (
        gpn_data(
            [
                "build",
                str(mixed_inputs),
                "--out",
                str(out),
                "--seq-len",
                "32",
                "--shard-size",
                "2kb",
                "-q",
            ]
        )
        == 0
    )
    shard = sorted((out / "train").glob("*.zstd"))[-1]
    shard.write_bytes(shard.read_bytes()[:-3] + b"xyz")
    capsys.readouterr()
    assert gpn_data(["verify", str(out), "-q"]) == 2
    captured = capsys.readouterr()
    assert f"BAD  train/{shard.name}: sha1 mismatch" in captured.out
    assert f"train/{shard.name}" in captured.err
    shard.unlink()
    assert gpn_data(["verify", str(out), "-q"]) == 2
    assert f"train/{shard.name}: missing" in capsys.readouterr().out


def test_default_corpus_is_real_text_deterministic_and_reused(tmp_path):
    docs = default_corpus_documents(max_bytes=200_000)
    assert sum(len(d) for d in docs) >= 200_000 and "assert" in docs[0]
    a = build_default_dataset(str(tmp_path / "a"), seq_len=128, max_bytes=200_000)
    b = build_default_dataset(str(tmp_path / "b"), seq_len=128, max_bytes=200_000)
    assert _tree_bytes(Path(a)) == _tree_bytes(Path(b))
    meta = read_metadata(a)
    assert (meta.vocab_size, meta.seq_len, meta.eod_token_id) == (257, 128, 256)
    assert meta.tokens("val") > 0 and meta.source["kind"] == "default-corpus"
    stamp = (Path(a) / "gpn_dataset.json").stat().st_mtime_ns
    assert build_default_dataset(a, seq_len=128, max_bytes=200_000) == a  # reused
    assert (Path(a) / "gpn_dataset.json").stat().st_mtime_ns == stamp
    with pytest.raises(DataError) as caught:
        build_default_dataset(a, seq_len=64, max_bytes=200_000)
    assert "--overwrite" in one_line(caught.value)
    build_default_dataset(a, seq_len=64, max_bytes=200_000, overwrite=True)
    assert read_metadata(a).seq_len == 64
