"""`io/run_folder.py` owns the layout of a run folder and of a checkpoint root: every file
name and marker is spelled there once, and step folders have one name and one parser."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpn_scale.io import run_folder

REPO = Path(__file__).resolve().parents[2]
OWNER = REPO / "gpn_scale" / "io" / "run_folder.py"
LAYOUT = {
    run_folder.RUN_CONFIG,
    run_folder.METRICS,
    run_folder.LOSS_CURVE,
    run_folder.FINAL_WEIGHTS,
    run_folder.MANIFEST,
    run_folder.LATEST,
    run_folder.DONE,
    run_folder.CHECKPOINTS,
    run_folder.DEFAULT_CORPUS_PREFIX,
}
STEP_PREFIX = "step_"


def _spellings(path: Path) -> list[str]:
    """Where `path` spells a layout name as a string of its own, or builds or slices a step
    folder name by hand (`"step_"`, f"step_{...}")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and node.value in LAYOUT | {STEP_PREFIX}:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
        if isinstance(node, ast.JoinedStr) and len(node.values) > 1:
            head, value = node.values[0], node.values[1]
            if (
                isinstance(head, ast.Constant)
                and head.value == STEP_PREFIX
                and isinstance(value, ast.FormattedValue)
            ):
                found.append(f"{path.relative_to(REPO)}:{node.lineno} f'step_{{...}}'")
    return found


def test_each_name_of_the_layout_is_spelled_once():
    files = [p for root in ("gpn_scale", "data_tools") for p in sorted((REPO / root).rglob("*.py"))]
    assert OWNER in files
    elsewhere = [s for p in files if p != OWNER for s in _spellings(p)]
    assert not elsewhere, f"spell these through gpn_scale.io.run_folder: {elsewhere}"
    assert len(_spellings(OWNER)) >= len(LAYOUT)  # the check sees them where they are defined


def test_the_check_sees_a_hand_spelled_name(tmp_path):
    src = tmp_path / "gpn_scale" / "m.py"
    src.parent.mkdir()
    src.write_text(
        'a = "metrics.jsonl"\nb = f"step_{3:09d}"\nc = int(name[len("step_"):])\nd = "step_x"\n'
    )
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        found = {(s.split(":")[1].split(" ")[0], s.split(" ", 1)[1]) for s in _spellings(src)}
        assert {("1", "'metrics.jsonl'"), ("2", "f'step_{...}'"), ("3", "'step_'")} <= found
        assert not any(line == "4" for line, _ in found)  # "step_x": another name
    finally:
        REPO = saved


@pytest.mark.parametrize(
    "name, step",
    [
        ("step_000000200", 200),
        ("s3://b/run/checkpoints/step_000000007/", 7),
        ("/runs/a/checkpoints/step_1234567890", 1234567890),
        ("step_12", None),  # fewer than nine digits: not a step folder
        ("step_000000200.lambada.json", None),
        ("latest", None),
    ],
)
def test_one_parser_of_step_folder_names(name, step):
    assert run_folder.step_of(name) == step
    if step is not None and "/" not in name:
        assert run_folder.step_dir_name(step) == name
