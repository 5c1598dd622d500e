"""`gpn-scale train --dry-run`: the checks of a start, read-only; the resolved config and
what the run would use are printed; nothing is trained or written (issue 13, item 8)."""

from __future__ import annotations

from train_helpers import train_args

from gpn_scale.cli import main


def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_dry_run_prints_the_resolved_config_and_writes_nothing(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    before = _tree(tmp_path)
    assert main(train_args(corpus, run_dir, "schedule.total_steps=5") + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"run_dir: {run_dir}\n" in out  # the YAML, resolved
    assert f"  root: {run_dir / 'checkpoints'}\n" in out
    assert "  total_steps: 5\n" in out
    assert f"data: {corpus} (seq_len 64, vocab 257" in out
    assert f"run_dir: {run_dir} (would be created)" in out
    assert "nothing was trained or written" in out
    assert _tree(tmp_path) == before and not run_dir.exists()


def test_dry_run_fails_like_a_start_in_one_line(corpus, tmp_path, capsys):
    assert main(train_args(corpus, tmp_path / "run", "data.seq_len=32") + ["--dry-run"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("gpn-scale: error:")]
    assert len(err) == 1 and "data.seq_len=32 does not match" in err[0]
    assert (
        main(
            train_args(corpus, tmp_path / "run") + ["--dry-run", "--resume", str(tmp_path / "nope")]
        )
        == 2
    )
    assert not (tmp_path / "run").exists()


def test_dry_run_lists_an_s3_checkpoint_root_without_writing(
    corpus, tmp_path, capsys, s3_bucket, s3_endpoint
):
    bucket = s3_bucket.removeprefix("s3://")
    assert (
        main(
            train_args(corpus, tmp_path / "run", f"checkpoint.root={s3_bucket}/ck")
            + ["--dry-run", "--resume", "auto"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"checkpoints: {s3_bucket}/ck (listed: 0 entries; write access not probed)" in out
    assert "resume: auto: no complete checkpoint, would start fresh" in out
    assert s3_endpoint.client().list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def test_launch_check_and_latest_step_in_one_call(corpus, tmp_path, capsys):
    """slurm/train.sbatch's preflight, one python start: `--check-launch NODES PROCS
    --latest-step` checks the launch, then prints the newest checkpoint's step (-1: none,
    'done': the run finished); a launch that does not split prints no step (one line, 2)."""
    from gpn_scale.train.preflight import DONE_MARKER

    run_dir = tmp_path / "run"
    args = train_args(corpus, run_dir) + ["--latest-step", "--check-launch"]
    assert main([*args, "1", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "-1"
    tp2 = train_args(corpus, run_dir, "parallel.tp=2") + ["--latest-step", "--check-launch"]
    assert main([*tp2, "1", "3"]) == 2
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err.startswith("gpn-scale: error: parallel.tp: 2 ")
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / DONE_MARKER).write_text("{}")
    assert main([*args, "2", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "done"


def test_launch_check_and_latest_step_import_no_torch(corpus, tmp_path):
    """The same call as train.sbatch makes it, twice a job: no torch import (it was 3-4
    CPU-seconds of each call). A complete step folder is found past a newer unfinished one."""
    import hashlib
    import json
    import subprocess
    import sys

    from gpn_scale.checkpoint.catalog import FORMAT, MANIFEST

    root = tmp_path / "run" / "checkpoints"
    done = root / "step_000000002"
    done.mkdir(parents=True)
    blob = done / "rank_00000.pt"
    blob.write_bytes(b"state")
    entry = {"size": 5, "sha256": hashlib.sha256(b"state").hexdigest()}
    manifest = {"format": FORMAT, "files": {blob.name: entry}}
    (done / MANIFEST).write_text(json.dumps(manifest))
    (root / "step_000000004").mkdir()  # a save that did not finish: no manifest
    (root / "step_000000004" / "rank_00000.pt").write_bytes(b"part")
    argv = train_args(corpus, tmp_path / "run") + ["--check-launch", "1", "2", "--latest-step"]
    code = (
        "import sys; from gpn_scale.cli import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "2"
