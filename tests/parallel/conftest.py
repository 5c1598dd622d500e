from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))


@pytest.fixture(scope="session")
def corpus(default_corpus: str) -> str:
    """The default corpus at seq_len 64 (tests/conftest.py's one build per session)."""
    return default_corpus
