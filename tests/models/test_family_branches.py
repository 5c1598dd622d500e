"""Nothing outside gpn_scale/models/ branches on a family (issue 35): a module that needs to
know what a family can do asks its spec (models/protocol.py's FamilySpec), so adding a family
is its folder and its registry line (docs/families.md, "Adding a family")."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gpn_scale"
FAMILIES = {"gpn", "transformer_pp", "gated_deltanet"}
MODEL_CLASSES = ("GPN", "TransformerPP", "GatedDeltaNet")
# Same word, another concept: the memory's update rule ("gpn" error against M, "gdn"
# against a * M), which both GPN+M and Gated DeltaNet call by name.
NOT_A_FAMILY = {"gpn_scale/ops/memory.py"}


def _branches(path: Path, rel: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), rel)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            names = {
                n.value
                for operand in operands
                for n in ast.walk(operand)
                if isinstance(n, ast.Constant) and n.value in FAMILIES
            }
            if names:
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
            if len(node.args) == 2 and any(c in ast.unparse(node.args[1]) for c in MODEL_CLASSES):
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    return found


def test_nothing_outside_models_branches_on_a_family():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if not rel.startswith("gpn_scale/models/") and rel not in NOT_A_FAMILY:
            found += _branches(path, rel)
    assert not found, f"ask the family's spec instead: {found}"


def test_the_check_sees_a_branch(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "def f(spec, model):\n"
        "    if spec.name == 'gpn':\n"
        "        return 1\n"
        "    return isinstance(model, GPN) or spec.name in ('transformer_pp', 'x')\n"
    )
    assert len(_branches(src, "m.py")) == 3
