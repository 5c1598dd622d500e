"""Data tests: each test gets its own TMPDIR (see `private_tmpdir` in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _own_tmpdir(private_tmpdir: Path) -> Path:
    return private_tmpdir
