"""Issue 36, item 5: misleading messages (cases 15-22) replaced by lines that name the cause
and the fix (exit 2), and the preemption windows of a save and of the start-up.

15 an empty config.yaml is never read as the defaults: the newest checkpoint's recorded
   config stands in (one line), or one line refuses naming the file and the fix;
18 non-UTF-8 input to `gpn-data build` is refused naming the file and the byte offset
   (`--encoding-errors replace` reads it as U+FFFD when asked);
19 a preemption signal during a scheduled save exits with that save, no step more;
20 a password in S3_ENDPOINT_URL never reaches a message;
21 SIGTERM / SIGUSR1 in the first moments of `gpn-scale train` exit 75, nothing written;
22 an unwritable staging directory names checkpoint.root, not a Python argument.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from train_helpers import REPO, SEQ_LEN, child_env, read_metrics

from gpn_scale import cli
from gpn_scale.train.signals import EXIT_PREEMPTED


def _train_in_process(corpus: str, run_dir: Path, *overrides: str) -> int:
    return cli.main(
        [
            "train",
            "ci_tiny",
            f"data.remote={corpus}",
            f"data.seq_len={SEQ_LEN}",
            f"run_dir={run_dir}",
            "checkpoint.every_steps=1",
            "schedule.warmup_steps=1",
            *overrides,
        ]
    )


def _steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


# ---------------------------------------------------------------------------------- 15
def test_empty_config_yaml_uses_the_checkpoints_recorded_config(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _train_in_process(corpus, run_dir, "schedule.total_steps=2") == 0
    (run_dir / "config.yaml").write_text("")
    capsys.readouterr()
    assert cli.main(["eval", str(run_dir), "--json"]) == 0
    out, err = capsys.readouterr()
    manifest = run_dir / "checkpoints" / "step_000000002" / "manifest.json"
    assert f"config.yaml is empty; using the config recorded in {manifest}" in err, err
    assert "not the dataset" not in err, err  # the run's own data, not the default corpus
    assert '"eval/loss"' in out

    for step in _steps(run_dir):  # no checkpoint records the config: one line refuses
        (run_dir / "checkpoints" / step / "manifest.json").unlink()
    assert cli.main(["eval", str(run_dir), "--checkpoint", "none"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{run_dir / 'config.yaml'} is empty" in err and "restore config.yaml" in err, err


# ---------------------------------------------------------------------------------- 18
def test_non_utf8_input_is_refused_naming_the_file_and_offset(tmp_path, capsys):
    from data_tools.cli import main as gpn_data

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hello world\n" * 50 + b"caf\xe9 " + b"more text\n" * 50)
    out = tmp_path / "ds"
    args = ["build", str(bad), "--out", str(out), "--seq-len", "16", "--val-windows", "1", "-q"]
    assert gpn_data(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"{bad}: not UTF-8 text (byte 0xe9 at byte offset 603)" in err, err
    assert "--encoding-errors replace" in err
    assert not out.exists()
    assert gpn_data([*args, "--encoding-errors", "replace"]) == 0
    assert (out / "gpn_dataset.json").is_file()


# ---------------------------------------------------------------------------------- 19
def test_a_signal_during_a_save_exits_with_that_save(corpus, tmp_path, monkeypatch):
    from gpn_scale.train.checkpointing import RunCheckpoints

    real_save = RunCheckpoints.save

    def save_with_a_signal(self, *args, **kwargs):  # SLURM's USR1 lands mid-save
        os.kill(os.getpid(), signal.SIGUSR1)
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(RunCheckpoints, "save", save_with_a_signal)
    run_dir = tmp_path / "run"
    assert _train_in_process(corpus, run_dir, "schedule.total_steps=4") == EXIT_PREEMPTED
    assert _steps(run_dir) == ["step_000000001"]  # that save, no second one
    trained = [r["step"] for r in read_metrics(run_dir) if r.get("train/loss") is not None]
    assert trained == [1]


# ---------------------------------------------------------------------------------- 20
def test_no_endpoint_password_in_messages(tmp_path, monkeypatch, capsys):
    with socket.socket() as sock:  # a port nobody listens on: connection refused at once
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("S3_ENDPOINT_URL", f"http://alice:s3cr3t@127.0.0.1:{port}")
    for key, value in {
        "GPN_S3_RETRIES": "1",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["data", "inspect", "s3://no-such-bucket/ds"]) == 2
    err = capsys.readouterr().err
    assert "S3 unreachable" in err and f"alice:***@127.0.0.1:{port}" in err, err
    assert "s3cr3t" not in err, err


# ---------------------------------------------------------------------------------- 21
_SIGNAL_IN_STARTUP = textwrap.dedent(
    """
    import os, signal, sys
    from gpn_scale import cli
    import gpn_scale.run.config as config

    def signalled(real, sig):
        def call(*args, **kwargs):
            os.kill(os.getpid(), sig)  # the signal lands here, before the trainer exists
            return real(*args, **kwargs)
        return call

    cli.build_parser = signalled(cli.build_parser, signal.SIGUSR1)
    config.load_train_config = signalled(config.load_train_config, signal.SIGTERM)
    sys.exit(cli.main(sys.argv[1:]))
    """
)


def test_preemption_signals_in_the_start_up_exit_75_writing_nothing(corpus, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", _SIGNAL_IN_STARTUP, "train", "ci_tiny", f"data.remote={corpus}"]
        + [f"data.seq_len={SEQ_LEN}", f"run_dir={run_dir}", "schedule.total_steps=2"],
        cwd=REPO,
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    assert f"stopped (signal {int(signal.SIGTERM)}) during the setup" in out, out[-3000:]
    assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))


# ---------------------------------------------------------------------------------- 22
@pytest.mark.parametrize("where", ["preflight", "save"])
def test_unwritable_staging_names_the_setting_to_change(tmp_path, where):
    from gpn_scale.checkpoint import CheckpointError, CheckpointManager

    root = tmp_path / "ckpt"
    mgr = CheckpointManager(str(root))
    root.mkdir()
    (root / ".staging").write_text("not a directory")  # as a read-only root refuses it
    with pytest.raises(CheckpointError) as info:
        mgr.preflight() if where == "preflight" else mgr._begin(1, {"step": 1})
    msg = str(info.value)
    assert "make checkpoint.root writable, or set checkpoint.root=DIR" in msg, msg
    assert "staging_dir" not in msg, msg
