from __future__ import annotations

from pathlib import Path

import pytest
import train_helpers


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The default corpus (byte-level, seq_len 64), built once per session (~20 s)."""
    return train_helpers.build_corpus(tmp_path_factory.getbasetemp())


@pytest.fixture(autouse=True)
def _own_tmpdir(private_tmpdir: Path) -> Path:
    """One TMPDIR per test (see `private_tmpdir` in tests/conftest.py)."""
    return private_tmpdir
