from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
import train_helpers  # noqa: E402


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The default corpus (byte-level, seq_len 64), built once per session (~20 s)."""
    return train_helpers.build_corpus(tmp_path_factory.getbasetemp())
