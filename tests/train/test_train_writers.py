"""What the trainer writes beside its checkpoints (issue 36): a disk that refuses a write is
one line (exit 2), and the history and config are on disk before each checkpoint is. In
process, with the disk's failures injected (no chmod: tests may run as root)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpn_scale.run.config import load_train_config
from gpn_scale.train.loop import Trainer
from gpn_scale.train.state import TrainState


def test_a_disk_that_refuses_a_write_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36 case 3: a run_dir that filled up or turned read-only mid-run ended in a
    traceback and exit 1. Any write the disk refuses (full, read-only, no permission) is one
    line naming the file, the cause and the fix, exit 2; another OSError (a bug) keeps its
    traceback."""
    from gpn_scale.cli import main

    target = tmp_path / "run" / "model_final.pt"
    args = ["train", "ci_tiny", f"run_dir={tmp_path / 'run'}"]
    for code, words, fix in (
        (errno.ENOSPC, "No space left on device", "free disk space"),
        (errno.EROFS, "Read-only file system", "choose a writable"),
    ):

        def refused(self, code=code, words=words):  # type: ignore[no-untyped-def]
            raise OSError(code, words, str(target))

        monkeypatch.setattr(Trainer, "run", refused)
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(target) in err[0], err
        assert words in err[0] and fix in err[0], err

    def bug(self):  # type: ignore[no-untyped-def]
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/nowhere")

    monkeypatch.setattr(Trainer, "run", bug)
    with pytest.raises(FileNotFoundError):
        main(args)


def test_history_and_config_are_on_disk_before_each_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36 case 4: metrics.jsonl and config.yaml were never fsynced while checkpoints
    were: after a filesystem abort both were empty and the checkpoints of steps 5 and 10
    there. config.yaml is written whole and fsynced; at each checkpoint the history up to
    its step is fsynced before the checkpoint is written, and its checkpoint row after."""
    from gpn_scale.models.registry import load_model_config
    from gpn_scale.train.sinks import open_sinks

    synced: list[tuple[str, int]] = []  # (the file's name when fsynced, its size then)
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("an earlier attempt's config\n")
    cfg = load_train_config("ci_tiny", [f"run_dir={run_dir}", "logging.wandb.mode=disabled"])
    trainer = Trainer(cfg)
    trainer._sinks, _ = open_sinks(
        cfg, str(run_dir), None, None, load_model_config("tiny")[1], 1, print
    )
    config = (run_dir / "config.yaml").read_text()
    assert "an earlier" not in config
    assert [n for n, size in synced if "config.yaml" in n and size == len(config.encode())]

    metrics = run_dir / "metrics.jsonl"
    for step in range(1, 11):
        trainer._emit({"train/loss": 1.0 / step}, step, step * 64)
    at_save: dict[str, object] = {}

    def save(*args: object) -> str:
        at_save["size"] = metrics.stat().st_size
        at_save["synced"] = [size for n, size in synced if n == str(metrics)]
        return str(run_dir / "checkpoints" / "step_000000010")

    trainer.ckpt = SimpleNamespace(save=save)  # type: ignore[assignment]
    trainer._save(
        SimpleNamespace(train_module=None, train_loader=None, model_cfg=None), TrainState(10)
    )
    assert at_save["synced"] and at_save["synced"][-1] == at_save["size"]  # type: ignore[index]
    assert [size for n, size in synced if n == str(metrics)][-1] == metrics.stat().st_size
    assert '"event": "checkpoint"' in metrics.read_text().splitlines()[-1]
    for sink in trainer._sinks:
        sink.close()
