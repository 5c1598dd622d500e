"""The commit protocol of `CheckpointManager.save` (gpn_scale/checkpoint/manager.py) with a
failure injected at each of its stages: the DCP write and the rank file into staging, each
file's upload (the storage writer raising at its Nth write, or a file landing short), the
manifest, the `latest` pointer, retention.

The manifest is written only after every file landed and verified, `latest` only after the
manifest. A save that fails at any stage raises one line and leaves the previous checkpoint
the newest complete one: nothing (a manifest, the pointer, `latest()` of this or of a new
manager, a resume) claims the broken one complete, and the same step saves again after.
One process, a local root in the test's own directory; a few ms a save."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import app_state, trained

from gpn_scale.checkpoint import CheckpointError, CheckpointManager, step_dir_name, writers
from gpn_scale.checkpoint.catalog import LATEST, MANIFEST

FILES = {"tokenizer.json": b'{"kind": "bytes"}'}  # a small file rank 0 adds (as the trainer)


def _save(mgr: CheckpointManager, step: int) -> str:
    model, opt = trained(seed=step)
    return mgr.save(
        step, app_state(model, opt), meta={"step": step}, rank_state={"n": step}, files=FILES
    )


class Writes:
    """Every write of the storage (put_file, put_bytes) in order, as (kind, key); `fail`
    decides per write whether it raises (and `torn` whether a file lands short first)."""

    def __init__(self, mgr: CheckpointManager, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, str]] = []
        self.fail: Callable[[int, str], bool] = lambda n, key: False
        self.torn: Callable[[int, str], bool] = lambda n, key: False
        storage = mgr.storage
        real_put_file, real_put_bytes = storage.put_file, storage.put_bytes

        def put_file(local: Path, key: str) -> Any:
            n = self._count("file", key)
            if self.torn(n, key):  # the upload landed short and said nothing
                info = real_put_file(local, key)
                dest = Path(storage.uri) / key
                dest.write_bytes(dest.read_bytes()[:-1])
                return info
            self._maybe_fail(n, key)
            return real_put_file(local, key)

        def put_bytes(key: str, data: bytes) -> None:
            self._maybe_fail(self._count("bytes", key), key)
            real_put_bytes(key, data)

        monkeypatch.setattr(storage, "put_file", put_file)
        monkeypatch.setattr(storage, "put_bytes", put_bytes)

    def _count(self, kind: str, key: str) -> int:
        self.log.append((kind, key))
        return len(self.log)

    def _maybe_fail(self, n: int, key: str) -> None:
        if self.fail(n, key):
            raise CheckpointError(f"injected failure writing {key} (write {n})")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


def _step_keys(writes: Writes, step: int) -> list[str]:
    prefix = f"{step_dir_name(step)}/"
    return [key for _, key in writes.log if key.startswith(prefix) or key == LATEST]


def test_files_then_manifest_then_latest(root, monkeypatch):
    mgr = CheckpointManager(str(root))
    writes = Writes(mgr, monkeypatch)
    uri = _save(mgr, 1)
    name = step_dir_name(1)
    keys = [key for _, key in writes.log]
    assert keys[-2:] == [f"{name}/{MANIFEST}", LATEST]  # the pointer last, after the manifest
    data = keys[:-2]
    assert all(kind == "file" for kind, _ in writes.log[:-2])
    manifest = json.loads((root / name / MANIFEST).read_bytes())
    # Every file the manifest lists was written before it, and nothing else was.
    assert sorted(data) == sorted(f"{name}/{rel}" for rel in manifest["files"])
    assert {".metadata", "rank_00000.pt", "tokenizer.json"} <= set(manifest["files"])
    assert json.loads((root / LATEST).read_bytes()) == {"step": 1, "name": name}
    assert mgr.latest() == uri


def _stages(root: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys a save of step 2 over a saved step 1 writes, in order (a dry run)."""
    dry = CheckpointManager(str(root / "dry"))
    _save(dry, 1)
    writes = Writes(dry, monkeypatch)
    _save(dry, 2)
    return [key for _, key in writes.log]


# Where the Nth write fails: the first file's upload, the last file's, the manifest, `latest`.
WRITE_STAGES = ["first file", "last file", "manifest"]


def _nth(keys: list[str], stage: str) -> int:
    manifest = keys.index(f"{step_dir_name(2)}/{MANIFEST}")
    return {"first file": 1, "last file": manifest, "manifest": manifest + 1}.get(stage, len(keys))


def _assert_previous_is_newest(root: Path, uri1: str) -> None:
    """Step 1 is the newest complete checkpoint, by every reader; step 2 claims nothing."""
    broken = root / step_dir_name(2)
    assert not (broken / MANIFEST).exists()  # nothing claims it complete
    assert json.loads((root / LATEST).read_bytes())["name"] == step_dir_name(1)
    for mgr in (CheckpointManager(str(root)), CheckpointManager(str(root), keep_last=1)):
        assert mgr.latest() == uri1
        assert mgr.resolve_resume("auto") == uri1
        assert not mgr.is_complete(str(broken))
        assert [(s, ok) for s, _, ok in mgr.list_checkpoints() if s == 2] in ([], [(2, False)])
        assert mgr.is_complete(uri1)
    with pytest.raises(CheckpointError, match="cannot resume from"):
        CheckpointManager(str(root)).resolve_resume(str(broken))


def _assert_one_line(err: pytest.ExceptionInfo[CheckpointError]) -> None:
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(f"checkpoint {step_dir_name(2)} not saved")


def _assert_saves_again(mgr: CheckpointManager, root: Path, monkeypatch: Any) -> None:
    """The next save of the same step commits (the broken leftovers are replaced)."""
    monkeypatch.undo()
    uri2 = _save(mgr, 2)
    assert CheckpointManager(str(root)).latest() == uri2
    assert mgr.is_complete(uri2) and mgr.is_complete(mgr.storage.child_uri(step_dir_name(1)))
    assert not list(mgr.staging_root.rglob("*.distcp"))  # staging emptied


@pytest.mark.parametrize("stage", WRITE_STAGES)
def test_a_failed_write_leaves_the_previous_checkpoint_the_newest(root, monkeypatch, stage):
    keys = _stages(root, monkeypatch)
    mgr = CheckpointManager(str(root / "run"))
    uri1 = _save(mgr, 1)
    n = _nth(keys, stage)
    writes = Writes(mgr, monkeypatch)
    writes.fail = lambda i, key: i == n
    with pytest.raises(CheckpointError) as err:
        _save(mgr, 2)
    _assert_one_line(err)
    assert "injected failure" in str(err.value)
    assert writes.log[-1][1] == keys[n - 1]  # it failed where meant, and wrote nothing after
    assert len(writes.log) == n
    _assert_previous_is_newest(root / "run", uri1)
    assert not list(mgr.staging_root.rglob("*.distcp"))  # staging emptied
    _assert_saves_again(mgr, root / "run", monkeypatch)


def test_a_failed_latest_write_still_commits_the_step_and_says_so(root, monkeypatch):
    """The manifest is the commit: a `latest` that cannot be written after it leaves a
    complete checkpoint that every reader takes (newest complete beats a stale pointer), so
    the save says so in a warning rather than claiming the step was not saved."""
    mgr = CheckpointManager(str(root))
    _save(mgr, 1)
    writes = Writes(mgr, monkeypatch)
    writes.fail = lambda i, key: key == LATEST
    with pytest.warns(UserWarning, match=r"step_000000002 is saved, but latest still names"):
        uri2 = _save(mgr, 2)
    assert json.loads((root / LATEST).read_bytes())["name"] == step_dir_name(1)
    newest = CheckpointManager(str(root)).latest()
    assert newest == uri2 and CheckpointManager(str(root)).is_complete(newest)
    writes.fail = lambda i, key: False
    _save(mgr, 3)  # the next save writes the pointer again
    assert json.loads((root / LATEST).read_bytes())["name"] == step_dir_name(3)


def test_a_file_that_lands_short_is_caught_before_the_manifest(root, monkeypatch):
    mgr = CheckpointManager(str(root))
    uri1 = _save(mgr, 1)
    writes = Writes(mgr, monkeypatch)
    writes.torn = lambda i, key: key.endswith(".distcp")
    with pytest.raises(CheckpointError, match=r"verification failed: __0_0\.distcp is \d+ bytes"):
        _save(mgr, 2)
    assert (LATEST not in [k for _, k in writes.log]) and not (
        root / step_dir_name(2) / MANIFEST
    ).exists()
    _assert_previous_is_newest(root, uri1)
    _assert_saves_again(mgr, root, monkeypatch)


def test_a_failed_dcp_write_leaves_nothing_of_the_step(root, monkeypatch):
    import torch.distributed.checkpoint as dcp

    mgr = CheckpointManager(str(root))
    uri1 = _save(mgr, 1)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected: DCP could not write")

    monkeypatch.setattr(dcp, "save", broken)
    with pytest.raises(CheckpointError, match="DCP save failed .*injected") as err:
        _save(mgr, 2)
    _assert_one_line(err)
    assert not (root / step_dir_name(2)).exists()
    _assert_previous_is_newest(root, uri1)
    assert not any(p.is_file() for p in mgr.staging_root.rglob("*"))
    _assert_saves_again(mgr, root, monkeypatch)


def test_a_failed_rank_file_uploads_nothing(root, monkeypatch):
    mgr = CheckpointManager(str(root))
    uri1 = _save(mgr, 1)
    writes = Writes(mgr, monkeypatch)

    def broken(state: Any, path: Path) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(writers, "save_rank_state", broken)
    with pytest.raises(CheckpointError, match="cannot write rank_state") as err:
        _save(mgr, 2)
    _assert_one_line(err)
    assert writes.log == []  # not one file uploaded
    _assert_previous_is_newest(root, uri1)
    assert not any(p.is_file() for p in mgr.staging_root.rglob("*"))
    _assert_saves_again(mgr, root, monkeypatch)


def test_a_failed_retention_keeps_the_new_checkpoint_and_says_so(root, monkeypatch):
    mgr = CheckpointManager(str(root), keep_last=1)
    uri1 = _save(mgr, 1)

    def broken(current: str) -> None:
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(mgr, "_retain", broken)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        uri2 = _save(mgr, 2)
    assert any("checkpoint retention failed" in str(w.message) for w in said)
    assert CheckpointManager(str(root)).latest() == uri2
    assert CheckpointManager(str(root)).is_complete(uri1)  # not deleted: retention catches up
    monkeypatch.undo()
    uri3 = _save(mgr, 3)
    assert [s for s, _, _ in mgr.list_checkpoints()] == [3]  # caught up at the next save
    assert mgr.latest() == uri3
