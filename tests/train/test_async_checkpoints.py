"""checkpoint.async_mode (issue 36 item 6): the state is staged to CPU while training
waits, the write, upload and commit run in the background while the next steps train.

In-process tiny CPU runs (Trainer), with the storage's upload replaced where a test needs
to hold or fail it (an Event or an exception: no timing dependence); one subprocess run
killed with -9 while its background upload is held."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from train_helpers import REPO, child_env, kill9, train_args, train_losses

from gpn_scale.checkpoint import CheckpointError
from gpn_scale.core.config import ConfigError
from gpn_scale.io.storage import LocalStorage
from gpn_scale.run.config import load_train_config
from gpn_scale.train.loop import Trainer

TOTAL = 6
COMMON = (f"schedule.total_steps={TOTAL}", "checkpoint.every_steps=2", "checkpoint.keep_last=3")


def _cfg(corpus: str, run_dir: Path, *overrides: str):
    return load_train_config(
        "ci_tiny",
        [f"data.remote={corpus}", "data.seq_len=64", f"run_dir={run_dir}", *COMMON, *overrides],
    )


def _train(corpus: str, run_dir: Path, *overrides: str, resume: str = "none", log=None):
    return Trainer(_cfg(corpus, run_dir, *overrides), resume=resume, log=log).run()


def _latest(run_dir: Path) -> str | None:
    path = run_dir / "checkpoints" / "latest"
    return json.loads(path.read_text())["name"] if path.exists() else None


@pytest.fixture(scope="module")
def sync_losses(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("sync") / "run"
    _train(corpus, run_dir)
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, TOTAL + 1))
    return losses


def test_async_run_equals_sync_and_its_checkpoints_resume(corpus, tmp_path, sync_losses):
    run_dir = tmp_path / "run"
    lines: list[str] = []
    result = _train(corpus, run_dir, "checkpoint.async_mode=async", log=lines.append)
    assert result.exit_code == 0
    assert train_losses(run_dir) == sync_losses  # ==: the same floats
    assert _latest(run_dir) == "step_000000006"
    assert any("step 2: checkpoint" in x and "in the background" in x for x in lines), lines
    for step in (2, 4, 6):
        assert (run_dir / "checkpoints" / f"step_{step:09d}" / "manifest.json").exists()
    done = json.loads((run_dir / "checkpoints" / "DONE").read_text())
    assert done["checkpoint"] == "step_000000006"
    # A background-written checkpoint resumes to the same per-step losses.
    step4 = run_dir / "checkpoints" / "step_000000004"
    resumed = tmp_path / "resumed"
    _train(corpus, resumed, "checkpoint.async_mode=async", resume=str(step4))
    after = train_losses(resumed)
    assert after == {s: sync_losses[s] for s in (5, 6)}


def test_steps_run_while_a_save_is_in_flight(corpus, tmp_path, sync_losses, monkeypatch):
    """The upload of step 2's files is held by an Event; the loop trains steps 3 and 4
    meanwhile (step 2 not yet committed), then releases it; step 4's save waits for it."""
    uploading, release = threading.Event(), threading.Event()
    real_put = LocalStorage.put_file

    def held_put(self, path, key):  # type: ignore[no-untyped-def]
        if key.startswith("step_000000002/"):
            uploading.set()
            if not release.wait(120):
                raise RuntimeError("the held upload was never released: the loop stopped")
        return real_put(self, path, key)

    monkeypatch.setattr(LocalStorage, "put_file", held_put)
    run_dir = tmp_path / "run"
    seen_while_held: list[int] = []

    def log(line: str) -> None:
        for step in (3, 4):
            if f" step {step}/{TOTAL} |" in line:
                # The background save reaches its upload (it writes DCP's files first).
                assert uploading.wait(120), "the step 2 save never reached its upload"
                if not release.is_set() and _latest(run_dir) is None:  # not committed yet
                    seen_while_held.append(step)
                if step == 4:
                    release.set()

    result = _train(corpus, run_dir, "checkpoint.async_mode=async", "train.log_every=1", log=log)
    assert result.exit_code == 0
    assert seen_while_held == [3, 4]
    assert train_losses(run_dir) == sync_losses
    assert _latest(run_dir) == "step_000000006"


def test_a_failed_background_upload_is_one_line_and_resume_takes_the_previous(
    corpus, tmp_path, sync_losses, monkeypatch
):
    """Step 4's upload raises in the background: the run stops at its next save (step 6)
    with one line naming step 4; `latest` stays step 2, and --resume auto from there gives
    the uninterrupted run's losses."""
    real_put = LocalStorage.put_file

    def failing_put(self, path, key):  # type: ignore[no-untyped-def]
        if key.startswith("step_000000004/"):
            raise OSError(28, "No space left on device (injected)")
        return real_put(self, path, key)

    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(LocalStorage, "put_file", failing_put)
        with pytest.raises(CheckpointError) as err:
            _train(corpus, run_dir, "checkpoint.async_mode=async_with_pinned_mem")
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("background save of step 4 failed: checkpoint step_000000004 not saved")
    assert "previous latest is unchanged" in text
    assert _latest(run_dir) == "step_000000002"
    assert not (run_dir / "checkpoints" / "step_000000004" / "manifest.json").exists()
    _train(corpus, run_dir, "checkpoint.async_mode=async", resume="auto")
    assert train_losses(run_dir) == sync_losses
    assert _latest(run_dir) == "step_000000006"


def test_a_preemption_during_a_background_save_waits_for_it_and_resumes_equal(
    corpus, tmp_path, sync_losses, monkeypatch
):
    """SLURM's USR1 lands while step 2's files upload in the background (when that is, the
    background thread decides: the main thread may have trained on). The run stops at the
    step boundary after the signal (the last step logged then, or the one in progress),
    saves there after step 2's save commits, and exits 75: the newest checkpoint is
    complete and named by `latest`, nothing trained past it, and --resume auto gives the
    uninterrupted run's per-step losses."""
    import os
    import signal

    from gpn_scale.train.signals import EXIT_PREEMPTED

    real_put = LocalStorage.put_file
    logged: list[int] = [0]  # the last step the loop logged
    sent_after: list[int] = []  # the last logged step when the signal was sent

    def put_with_a_signal(self, path, key):  # type: ignore[no-untyped-def]
        if key.startswith("step_000000002/") and not sent_after:
            sent_after.append(logged[-1])
            os.kill(os.getpid(), signal.SIGUSR1)  # delivered to the main thread
        return real_put(self, path, key)

    def log(line: str) -> None:
        logged.extend(n for n in range(1, TOTAL + 1) if f" step {n}/{TOTAL} |" in line)

    run_dir = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(LocalStorage, "put_file", put_with_a_signal)
        result = _train(
            corpus, run_dir, "checkpoint.async_mode=async", "train.log_every=1", log=log
        )
    assert sent_after and result.exit_code == EXIT_PREEMPTED
    stopped = result.step
    assert sent_after[0] >= 2 and stopped in (sent_after[0], sent_after[0] + 1), (
        sent_after,
        stopped,
    )
    assert sorted(train_losses(run_dir)) == list(range(1, stopped + 1))
    assert _latest(run_dir) == f"step_{stopped:09d}"
    for folder in (run_dir / "checkpoints").glob("step_*"):
        assert (folder / "manifest.json").exists(), folder  # nothing left half-written
    _train(corpus, run_dir, "checkpoint.async_mode=async", resume="auto")
    assert train_losses(run_dir) == sync_losses


_HELD_CHILD = """
import sys, threading
from gpn_scale.io.storage import LocalStorage
real = LocalStorage.put_file
def held(self, path, key):
    if key.startswith("step_000000004/"):
        print("UPLOAD HELD", flush=True)
        threading.Event().wait()  # forever: the job is killed during this upload
    return real(self, path, key)
LocalStorage.put_file = held
from gpn_scale.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill9_during_a_background_upload_resumes_from_the_previous(corpus, tmp_path, sync_losses):
    run_dir = tmp_path / "run"
    args = train_args(corpus, run_dir, *COMMON, "checkpoint.async_mode=async")
    proc = subprocess.Popen(
        [sys.executable, "-c", _HELD_CHILD, *args],
        cwd=REPO,
        env=child_env(tmp_path),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    out: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if "UPLOAD HELD" in line:
            break
    else:
        raise AssertionError(f"the child never reached the upload:\n{''.join(out)}")
    kill9(proc)
    assert _latest(run_dir) == "step_000000002"
    resumed = subprocess.run(
        [sys.executable, "-m", "gpn_scale", *args, "--resume", "auto"],
        cwd=REPO,
        env=child_env(tmp_path),
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "step_000000002" in resumed.stdout
    assert train_losses(run_dir) == sync_losses


@pytest.mark.parametrize("value", ["asnyc", "on", "pinned", "1"])
def test_bad_async_mode_is_one_line(tmp_path, value):
    with pytest.raises(ConfigError) as err:
        load_train_config("ci_tiny", [f"run_dir={tmp_path}", f"checkpoint.async_mode={value}"])
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(
        "checkpoint.async_mode: expected one of off, async, async_with_pinned_mem"
    )


def test_async_mode_off_spellings_and_deepspeed(tmp_path):
    for value in ("off", "false"):
        cfg = load_train_config(
            "ci_tiny", [f"run_dir={tmp_path}", f"checkpoint.async_mode={value}"]
        )
        assert cfg.checkpoint.async_mode == "off"
    with pytest.raises(ConfigError, match=r"not deepspeed; set checkpoint.async_mode=off$"):
        load_train_config(
            "ci_tiny",
            [f"run_dir={tmp_path}", "checkpoint.async_mode=async", "parallel.backend=deepspeed"],
        )


@pytest.mark.slow
def test_two_gloo_ranks_fsdp2_async_equals_sync(corpus, tmp_path):
    """2 ranks (FSDP2 on gloo): the background's collectives (DCP's planning, the file
    lists, the commit) on a process group of its own while the training's all-reduces run
    on the default one; the losses equal the synchronous run's and the checkpoints resume."""
    from train_helpers import run_train

    runs = {}
    for mode in ("off", "async"):
        run_dir = tmp_path / mode
        run_train(corpus, run_dir, *COMMON, f"checkpoint.async_mode={mode}", nproc=2)
        runs[mode] = train_losses(run_dir)
        assert _latest(run_dir) == "step_000000006"
    assert runs["async"] == runs["off"]
    resumed = tmp_path / "resumed"
    step4 = tmp_path / "async" / "checkpoints" / "step_000000004"
    run_train(corpus, resumed, *COMMON, "checkpoint.async_mode=async", nproc=2, resume=str(step4))
    assert train_losses(resumed) == {s: runs["off"][s] for s in (5, 6)}
