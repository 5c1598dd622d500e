"""Lint in the suite: `ruff check`, `ruff format --check` (over gpn_scale, data_tools, tests) and
`mypy gpn_scale` (it ships py.typed) must pass, so the README's test command covers them.
Configuration: [tool.ruff] and [tool.mypy] in pyproject.toml (the known mypy exceptions are
listed there with their reasons). Skipped when ruff / mypy are not installed (the `test` extra
installs both)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ["gpn_scale", "data_tools", "tests"]


def _run(tool: str, *args: str) -> None:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (pip install -e '.[test]')")
    proc = subprocess.run(
        [sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    report = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, f"{tool} {' '.join(args)} failed:\n{report[-8000:]}"


def test_ruff_check() -> None:
    _run("ruff", "check", "--no-cache", *TREES)


def test_ruff_format() -> None:
    _run("ruff", "format", "--check", "--no-cache", *TREES)


@pytest.mark.slow  # ~35 s without a warm .mypy_cache
def test_mypy() -> None:
    _run("mypy")  # what and how: [tool.mypy] in pyproject.toml


def test_pre_commit_runs_the_same_ruff_over_the_same_trees() -> None:
    """.pre-commit-config.yaml's hooks are the lint above, so a commit that passes them passes
    CI's lint (ruff from the project's environment: the pinned version)."""
    import yaml

    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}
    assert hooks["ruff-check"]["entry"].split()[:2] == ["ruff", "check"]
    assert hooks["ruff-format"]["entry"].split() == ["ruff", "format"]
    for hook in hooks.values():
        assert hook["language"] == "system"
        assert hook["files"] == "^(" + "|".join(TREES) + ")/"
