"""README's "Layout" block names every package and top-level folder once, and only ones that
exist: a newcomer's map of the tree that cannot drift from it unnoticed."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Top-level folders a user works with (the rest are tests, docs and build outputs).
TOP_LEVEL = ("data_tools", "configs", "slurm")


def _layout_entries() -> list[str]:
    readme = (REPO / "README.md").read_text()
    block = re.search(r"^## Layout\n+```\n(.*?)^```", readme, re.M | re.S)
    assert block, "README.md has no ## Layout code block"
    # An entry starts a line; continuation lines of its description are indented.
    return [line.split()[0].rstrip("/") for line in block.group(1).splitlines() if line[:1].strip()]


def _packages() -> set[str]:
    root = REPO / "gpn_scale"
    return {
        f"gpn_scale/{p.parent.name}"
        for p in root.glob("*/__init__.py")
        if not p.parent.name.startswith("_")
    }


def test_readme_layout_lists_each_package_and_folder_once_and_only_real_ones():
    entries = _layout_entries()
    duplicates = sorted({e for e in entries if entries.count(e) > 1})
    assert not duplicates, f"listed more than once in README's layout: {duplicates}"
    missing = sorted((_packages() | set(TOP_LEVEL)) - set(entries))
    assert not missing, f"in the tree but not in README's layout: {missing}"
    absent = sorted(e for e in entries if not (REPO / e).exists())
    assert not absent, f"in README's layout but not in the tree: {absent}"
