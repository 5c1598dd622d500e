from __future__ import annotations

from pathlib import Path

import pytest

import train_helpers


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The default corpus (byte-level, seq_len 64), built once per session (~20 s)."""
    return train_helpers.build_corpus(tmp_path_factory.getbasetemp())


@pytest.fixture(autouse=True)
def private_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """streaming keeps filelocks in tempfile.gettempdir(): one TMPDIR per test."""
    import tempfile

    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"):
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)  # restored to "absent" even if the code under test sets it
    return tmp
