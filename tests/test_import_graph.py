"""The import graph of gpn_scale: no cycles, and dependencies that point down the layers
(core <- io <- data / checkpoint; core <- ops <- models <- accounting / parallel;
data / checkpoint / models <- run <- eval, train <- app), and the trainer imports nothing
from evaluation (checkpoint sources are run/sources.py's, below both; the live analyses are
a step callback that app/ attaches, train/callbacks.py the protocol the loop knows).

Every import counts, the lazy ones inside functions included (they are how a cycle hides:
the program runs, but neither module can be read or moved without the other), and for
cycles the type-only ones under `if TYPE_CHECKING:` too (a module cannot be read without
the types it names); the layers are of what runs. Parsed with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What each package may import besides itself (a package not listed may import anything
# below the cli). Read as the architecture: a leaf first, each one above those it lists.
ALLOWED = {
    "core": set(),
    "optim": set(),
    "io": {"core"},
    "data": {"core", "io"},
    "checkpoint": {"core", "io"},
    "ops": {"core"},
    "models": {"core", "ops"},
    # testing: the compile gate's "testing_tiny" cases are the tests' tiny GPN config
    "accounting": {"core", "ops", "models", "testing"},
    "parallel": {"core", "optim", "ops", "models"},
    # a run's config, the model it trains and its checkpoint sources (a reference, its
    # weights, its tokenizer): read by the trainer, evaluation and sweeps alike
    "run": {"core", "io", "data", "checkpoint", "ops", "models"},
    # evaluation reads runs and checkpoints through run/; never the trainer
    "eval": {"core", "io", "data", "checkpoint", "ops", "models", "run"},
    # the trainer: never evaluation (app/ joins the two: the commands, the step callbacks)
    "train": {"core", "optim", "io", "data", "checkpoint", "ops", "models", "parallel", "run"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in (REPO / "gpn_scale").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(
    module: str, path: Path, modules: dict[str, Path], type_only: bool = False
) -> set[str]:
    """The gpn_scale modules `module` imports (a name imported from a package resolves to
    its submodule when it is one, else to the package); `type_only`: those under
    `if TYPE_CHECKING:` too."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str | None] = set()
    todo: list[ast.AST] = [ast.parse(path.read_text(), str(path))]
    while todo:
        node = todo.pop()
        if not type_only and _is_type_checking(node):
            todo.extend(node.orelse)  # type: ignore[attr-defined]
            continue
        if isinstance(node, ast.Import):
            found.update(resolve(a.name) for a in node.names if a.name.startswith("gpn_scale"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.startswith("gpn_scale"):
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in modules else resolve(base))
        todo.extend(ast.iter_child_nodes(node))
    found.discard(None)
    found.discard(module)
    return found  # type: ignore[return-value]


def _graph(type_only: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules, type_only) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_cycle_finder_finds_a_cycle_through_a_lazy_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = _cycles(_graph(type_only=True))
    assert not cycles, "import cycles (lazy and type-only imports included): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_graph_for_cycles_sees_a_type_only_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gpn_scale.core import env\n"
    )
    modules = {"gpn_scale.m": src, "gpn_scale.core.env": src}
    assert _imports("gpn_scale.m", src, modules) == set()
    assert _imports("gpn_scale.m", src, modules, type_only=True) == {"gpn_scale.core.env"}


def test_imports_point_down_the_layers_and_nothing_imports_the_cli():
    graph = _graph()
    upward = set()
    for module, imported in graph.items():
        for target in imported:
            if target == "gpn_scale.cli":
                assert module == "gpn_scale.__main__", f"{module} imports gpn_scale.cli"
            allowed = ALLOWED.get(_package(module))
            if allowed is None or _package(target) in allowed | {_package(module)}:
                continue
            upward.add((module, target))
    assert not upward, f"imports against the layers: {sorted(upward)}"


def _every_import(path: Path, module: str) -> set[str]:
    """Every gpn_scale module name `path` imports, type-only and lazy imports included
    (relative ones resolved against `module`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.update(f"{base}.{a.name}" for a in node.names)
    return {name for name in found if name.startswith("gpn_scale.")}


def test_the_trainer_imports_nothing_from_evaluation():
    modules, found = _modules(), set()
    for module, path in modules.items():
        if _package(module) != "train":
            continue
        for name in _every_import(path, module):
            if _package(name) == "eval":
                found.add((module, name if name in modules else name.rsplit(".", 1)[0]))
    assert not found, (
        "gpn_scale.train imports gpn_scale.eval (use gpn_scale.run, or a step callback "
        f"attached in gpn_scale/app): {sorted(found)}"
    )


def test_the_trainer_check_sees_a_type_only_and_a_relative_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gpn_scale.eval.load import LoadedModel\n"
        "def f():\n    from ..eval import export\n"
    )
    found = _every_import(src, "gpn_scale.train.m")
    assert {"gpn_scale.eval.load.LoadedModel", "gpn_scale.eval.export"} <= found
