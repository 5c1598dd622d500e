"""`gpn-data build PREFIX --format megatron`: a corpus written by megatron-core's own builder
(IndexedDatasetBuilder) comes out as the windows of its documents, EOD as configured, with the
vocabulary checked first; the trainer runs on the result."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from data_tools.cli import main as gpn_data
from gpn_scale.data import read_metadata

EOD = 256  # the byte tokenizer's end-of-document id (vocabulary 257)


def _builder(prefix: Path):
    with warnings.catch_warnings():  # megatron-core's package warns about Apex / TE at import
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    return IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)


def write_corpus(prefix: Path, seed: int, n_docs: int) -> list[list[int]]:
    """Documents of byte ids as Megatron's preprocessing writes them: odd documents end with
    the EOD id (preprocess_data.py --append-eod), even ones do not; document 3 is two
    sequences (a sentence-split document); one empty document. Returns the documents."""
    rng = np.random.default_rng(seed)
    builder = _builder(prefix)
    docs = []
    for d in range(n_docs):
        ids = rng.integers(0, 256, int(rng.integers(20, 90))).tolist()
        if d % 2:
            ids.append(EOD)
        if d == 3:  # two sentences, one document
            builder.add_item(torch.tensor(ids[:7]))
            builder.add_item(torch.tensor(ids[7:]))
            builder.end_document()
        else:
            builder.add_document(ids, [len(ids)])
        docs.append(ids)
        if d == 5:
            builder.add_document([], [0])
    builder.finalize(str(prefix) + ".idx")
    return docs


def windows_of(root: Path, split: str, tmp: Path) -> np.ndarray:
    """Every window of a split, in the written order (shards decompressed into `tmp`)."""
    import json
    import shutil

    from streaming import LocalDataset
    from streaming.base.compression import decompress

    local = tmp / f"plain_{split}"
    shutil.copytree(root / split, local)
    for shard in json.loads((local / "index.json").read_text())["shards"]:
        packed = local / shard["zip_data"]["basename"]
        raw = decompress(shard["compression"], packed.read_bytes())
        (local / shard["raw_data"]["basename"]).write_bytes(raw)
    ds = LocalDataset(local=str(local))
    return np.stack([ds[i]["tokens"] for i in range(len(ds))]).astype(np.int64)


def expected_stream(docs: list[list[int]], mode: str) -> list[int]:
    stream: list[int] = []
    for ids in docs:
        stream += ids
        if mode == "append" or (mode == "auto" and ids[-1] != EOD):
            stream.append(EOD)
    return stream


@pytest.mark.parametrize("mode", ["auto", "append", "none"])
def test_megatron_corpus_in_as_the_same_tokens(tmp_path, capsys, mode):
    folder = tmp_path / "megatron"
    folder.mkdir()
    # a folder of two prefixes: read in sorted order
    docs = write_corpus(folder / "a_part", 0, 9) + write_corpus(folder / "b_part", 1, 7)
    seq_len, out = 32, tmp_path / "out"
    argv = ["build", str(folder), "--format", "megatron", "--megatron-eod", mode]
    argv += ["--seq-len", str(seq_len), "--val-windows", "3", "--out", str(out)]
    assert gpn_data(argv) == 0
    assert "Megatron documents" in capsys.readouterr().out

    stream = expected_stream(docs, mode)
    n = len(stream) // seq_len
    want = np.array(stream[: n * seq_len]).reshape(n, seq_len)
    order = np.random.default_rng(0).permutation(n)  # the build's shuffle (--seed 0)
    assert np.array_equal(windows_of(out, "train", tmp_path), want[order[: n - 3]])
    assert np.array_equal(windows_of(out, "val", tmp_path), want[order[n - 3 :]])

    meta = read_metadata(str(out))
    assert (meta.vocab_size, meta.eod_token_id, meta.seq_len) == (257, EOD, seq_len)
    assert meta.source["format"] == "megatron" and meta.source["documents"] == len(docs)
    facts = meta.source["megatron"]
    assert facts["empty_documents"] == 2 and facts["eod"] == mode
    assert facts["eod_appended"] == len(stream) - sum(len(d) for d in docs)
    assert [Path(p["prefix"]).name for p in facts["prefixes"]] == ["a_part", "b_part"]
    assert meta.total_tokens == len(stream)


def test_megatron_ids_beyond_the_vocabulary_are_one_line_and_nothing_is_lost(tmp_path, capsys):
    prefix = tmp_path / "corpus"
    builder = _builder(prefix)
    builder.add_document([1, 2, 3, 31999, 4], [5])  # a LLaMA-2 id
    builder.finalize(str(prefix) + ".idx")
    out = tmp_path / "out"
    good = write_corpus(tmp_path / "good", 0, 6)
    assert good
    base = ["build", "--format", "megatron", "--seq-len", "8", "--out", str(out)]
    assert gpn_data([*base[:1], str(tmp_path / "good"), *base[1:]]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()

    assert gpn_data([*base[:1], str(prefix) + ".bin", *base[1:], "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "token id 31999 is outside the tokenizer's vocabulary" in err
    assert "--tokenizer" in err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # kept whole

    assert gpn_data(["build", str(tmp_path / "nothing"), "--format", "megatron", "--out",
                     str(tmp_path / "o2")]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "PREFIX.bin + PREFIX.idx" in err
    assert not (tmp_path / "o2").exists()


def test_trainer_runs_on_a_converted_megatron_corpus(tmp_path, capsys):
    from gpn_scale.cli import main as gpn_scale

    prefix = tmp_path / "corpus"
    write_corpus(prefix, 0, 60)
    out = tmp_path / "data"
    assert gpn_data(["build", str(prefix), "--format", "megatron", "--seq-len", "64",
                     "--val-windows", "4", "--out", str(out)]) == 0  # fmt: skip
    run = tmp_path / "run"
    argv = ["train", "ci_tiny", f"data.remote={out}", "data.seq_len=64", f"run_dir={run}"]
    argv += ["schedule.total_steps=2", "schedule.warmup_steps=1", "checkpoint.every_steps=0"]
    assert gpn_scale(argv) == 0
    assert "done: step 2" in capsys.readouterr().out
    assert (run / "checkpoints" / "DONE").is_file()
