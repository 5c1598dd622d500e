"""Logs that work under SLURM and Ctrl-C that saves (issue 13 item 7): with stderr not a
terminal there is no tqdm bar (no carriage returns) but a plain line every
train.log_every steps; the first SIGINT saves at the step's end and exits 75 like SIGTERM,
a second one aborts without saving."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest
from train_helpers import (
    REPO,
    child_env,
    cli,
    read_metrics,
    run_train,
    start_train,
    train_args,
    train_losses,
    wait_for_step,
)

from gpn_scale.train.signals import EXIT_ABORTED, EXIT_PREEMPTED

pytestmark = pytest.mark.slow

LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d "  # ISO 8601 with the UTC offset
    r"step (\d+)/6 \| loss \d+\.\d{4} \| lr \d\.\d{3}e-\d\d \| [\d,]+ tok/s \| "
    r"MFU (n/a|\d+\.\d%) \| ETA \d+:\d\d:\d\d$"
)


def test_no_tty_plain_lines_every_log_every_steps(corpus, tmp_path):
    run_dir = tmp_path / "run"
    # Bytes, not text: text mode would turn tqdm's carriage returns into newlines.
    proc = subprocess.run(
        cli()
        + train_args(
            corpus,
            run_dir,
            "schedule.total_steps=6",
            "schedule.warmup_steps=1",
            "checkpoint.every_steps=0",
            "train.progress_bar=true",
            "train.log_every=2",
        ),
        cwd=REPO,
        env=child_env(tmp_path),
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert b"\r" not in proc.stdout + proc.stderr  # pipes, no terminal: no tqdm bar
    assert b"step/s" not in proc.stderr
    out = proc.stdout.decode()
    steps = [int(m.group(1)) for line in out.splitlines() if (m := LINE.match(line))]
    assert steps == [2, 4, 6], out
    assert re.search(r"^summary: 6 step\(s\) in 0:\d\d:\d\d wall time \| mean", out, re.M), out


def test_ctrl_c_during_the_setup_stops_without_training(corpus, tmp_path):
    """A first Ctrl-C before step 1 used to train a step only to save it: it now stops
    there, says so, leaves nothing new behind and exits 75 (a rerun starts afresh)."""
    run_dir = tmp_path / "run"
    proc = start_train(corpus, run_dir, "debug.setup_sleep=30")
    deadline = time.time() + 180
    seen = ""
    while "sleeping 30s at the end of the setup" not in seen:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, seen
        seen += line
        assert time.time() < deadline, seen
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    out = seen + out
    assert proc.returncode == EXIT_PREEMPTED, out[-2000:]
    assert "interrupted (Ctrl-C) during the setup: stopping before the first step" in out
    assert "stopped (Ctrl-C) during the setup, before step 1: nothing trained or saved" in out
    assert "Traceback" not in out and "step 1/" not in out and "saving a checkpoint" not in out
    assert not run_dir.exists()  # nothing of the run was left behind


def test_first_ctrl_c_saves_and_exits_75(corpus, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_train(
        corpus,
        run_dir,
        "schedule.total_steps=8",
        "checkpoint.every_steps=0",
        "debug.step_sleep=0.4",
    )
    wait_for_step(proc, run_dir, 2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, out[-2000:]
    assert "press Ctrl-C again to abort" in out and "Traceback" not in out
    stopped = [r["step"] for r in read_metrics(run_dir) if r.get("event") == "preempted"]
    assert len(stopped) == 1 and stopped[0] < 8
    saved = [r for r in read_metrics(run_dir) if r.get("event") == "checkpoint"]
    assert [r["step"] for r in saved] == stopped
    run_train(corpus, run_dir, "schedule.total_steps=8", "checkpoint.every_steps=0")
    assert sorted(train_losses(run_dir)) == list(range(1, 9))  # continued, nothing lost


def test_second_ctrl_c_aborts_without_saving(corpus, tmp_path):
    run_dir = tmp_path / "run"
    # A long pause after each step: the second Ctrl-C lands before the step's end.
    proc = start_train(
        corpus, run_dir, "schedule.total_steps=8", "checkpoint.every_steps=0", "debug.step_sleep=20"
    )
    wait_for_step(proc, run_dir, 1)
    proc.send_signal(signal.SIGINT)
    seen = []
    for line in proc.stdout:  # the handler's line: the first signal has been taken
        seen.append(line)
        if "press Ctrl-C again" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    out = "".join(seen) + out
    assert proc.returncode == EXIT_ABORTED, out[-2000:]
    assert out.strip().splitlines()[-1].startswith("gpn-scale: aborted by Ctrl-C")
    assert "Traceback" not in out
    assert not [r for r in read_metrics(run_dir) if r.get("event") == "checkpoint"]
    assert not (run_dir / "checkpoints" / "DONE").exists()
