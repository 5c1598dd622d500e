"""A garbage `train/index.json` (issue 36, item 4, case 6): `gpn-scale train` exits 2 with
one line naming the file and `gpn-data verify` (it was a 51-line JSONDecodeError traceback),
and the failed start removes the folders it created (run folder, data cache, checkpoint
staging) and only those."""

from __future__ import annotations

import shutil

from train_helpers import train_args

from gpn_scale.cli import main


def test_a_garbage_index_is_one_line_and_leaves_nothing(corpus, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    (data / "train" / "index.json").write_text('{"version": 2, "shards": [')
    kept = tmp_path / "kept"  # there before the run: stays, with what was in it
    (kept / "notes.txt").parent.mkdir()
    (kept / "notes.txt").write_text("mine")
    run, cache, ckpt = tmp_path / "new" / "run", kept / "cache", tmp_path / "ck" / "root"
    args = train_args(
        str(data), run, f"data.local_cache={cache}", f"checkpoint.root={ckpt}",
        "checkpoint.every_steps=0",
    )  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("gpn-scale: error:")]
    assert len(errors) == 1 and not any("Traceback" in line for line in err), err
    assert f"{data}/train/index.json is not a valid index" in errors[0]
    assert f"gpn-data verify {data}" in errors[0]
    assert not (tmp_path / "new").exists() and not (tmp_path / "ck").exists()
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
