"""Data tests: each test gets its own TMPDIR (streaming keeps filelocks and its default
cache in tempfile.gettempdir(); sharing one between tests makes them interfere)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def private_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    # streaming reads the topology from these; a test sets them when it needs to.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
        # set-then-delete so that pytest restores "absent" after the test even if the
        # code under test (build_loader) sets them
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)
    return tmp
