from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def corpus(default_corpus: str) -> str:
    """The default corpus at seq_len 64 (tests/conftest.py's one build per session)."""
    return default_corpus


@pytest.fixture(autouse=True)
def _own_tmpdir(private_tmpdir: Path) -> Path:
    """One TMPDIR per test (see `private_tmpdir` in tests/conftest.py)."""
    return private_tmpdir
