"""The trainer stays readable: no function in gpn_scale/train over 80 lines, and the loop
module (the recipe) within 600. A function that grows past that is split where it reads."""

from __future__ import annotations

import ast
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[1] / "gpn_scale" / "train"
MAX_FUNCTION_LINES = 80
MAX_LOOP_LINES = 600


def _functions(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        (node.end_lineno - node.lineno + 1, f"{path.name}:{node.lineno} {node.name}")
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno
    ]


def test_no_function_in_train_is_over_80_lines():
    sizes = [f for path in sorted(TRAIN.rglob("*.py")) for f in _functions(path)]
    assert sizes, "no functions found: wrong path"
    long = sorted(f for f in sizes if f[0] > MAX_FUNCTION_LINES)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def test_the_loop_module_is_at_most_600_lines():
    lines = len((TRAIN / "loop.py").read_text().splitlines())
    assert lines <= MAX_LOOP_LINES, f"train/loop.py is {lines} lines (> {MAX_LOOP_LINES})"


def test_the_counter_sees_a_long_function(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n" + "    x = 1\n" * 90)
    assert _functions(src) == [(91, "m.py:1 f")]


def test_test_files_have_unique_names():
    """pytest imports test files by basename (rootdir mode, no packages under tests/): a
    second tests/<dir>/test_x.py is not collected, the run ends in one error."""
    tests = Path(__file__).resolve().parent
    names: dict[str, list[str]] = {}
    for path in tests.rglob("test_*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert not {n: p for n, p in names.items() if len(p) > 1}
