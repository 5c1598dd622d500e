"""`lm_eval --model gpn_scale` from the harness's own CLI, and `gpn-scale eval --lm-eval`.

The harness has no plugin discovery; setup.py installs gpn_scale_lm_eval.pth, which imports
gpn_scale/eval/lm_eval_hook.py at interpreter start. These tests check that both wheel kinds
carry the .pth and that the real CLI then finds the model.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from eval_helpers import write_tasks

pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parents[2]


def _pth_line() -> str:
    """The .pth line setup.py writes (read from setup.py without running it)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    values = {
        node.targets[0].id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    hook = ast.literal_eval(values["HOOK"])
    line = values["LINE"]
    assert isinstance(line, ast.JoinedStr)  # f'...{HOOK}...'
    parts = [
        v.value if isinstance(v, ast.Constant) else hook for v in line.values
    ]  # the one placeholder is HOOK
    return "".join(str(p) for p in parts)


def test_wheels_and_editable_installs_carry_the_pth(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "build")
    for name in ("gpn_scale", "data_tools"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    out = tmp_path / "dist"
    for hook in ("build_wheel", "build_editable"):  # one process each (setuptools keeps state)
        code = f"from setuptools import build_meta as b; import sys; b.{hook}(sys.argv[1])"
        proc = subprocess.run(
            [sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
    wheels = sorted(out.glob("*.whl"))
    assert len(wheels) == 2, wheels
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            assert zf.read("gpn_scale_lm_eval.pth").decode() == _pth_line(), wheel.name


def _installed_pth() -> Path | None:
    for d in site.getsitepackages():
        if (Path(d) / "gpn_scale_lm_eval.pth").is_file():
            return Path(d) / "gpn_scale_lm_eval.pth"
    return None


@pytest.mark.slow
def test_the_lm_eval_cli_finds_model_gpn_scale(tmp_path: Path, gpn_m_checkpoint: str) -> None:
    tasks = write_tasks(tmp_path)
    out = tmp_path / "results"
    cli = [
        "run", "--model", "gpn_scale", "--model_args", f"checkpoint={gpn_m_checkpoint}",
        "--device", "cpu", "--tasks", "gpn_tiny_choice", "--include_path", str(tasks),
        "--output_path", str(out),
    ]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    if _installed_pth() is not None:  # an install from this tree: the real entry point
        cmd = [sys.executable, "-m", "lm_eval", *cli]
    else:  # the shared venv predates setup.py: the same .pth, from a site dir of our own
        sitedir = tmp_path / "site"
        sitedir.mkdir()
        (sitedir / "gpn_scale_lm_eval.pth").write_text(_pth_line())
        boot = (
            "import site, sys; site.addsitedir(sys.argv.pop(1)); "
            "from lm_eval.__main__ import cli_evaluate; sys.argv[0] = 'lm_eval'; cli_evaluate()"
        )
        cmd = [sys.executable, "-c", boot, str(sitedir), *cli]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    assert 0.0 <= results["gpn_tiny_choice"]["acc,none"] <= 1.0


def test_gpn_scale_eval_lm_eval_writes_the_harness_results(
    tmp_path: Path, gpn_m_checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpn_scale.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = write_tasks(tmp_path)
    argv = ["eval", gpn_m_checkpoint, "--lm-eval", "gpn_tiny_choice", "--include-path", str(tasks)]
    assert main([*argv, "--device", "cpu"]) == 0
    saved = json.loads(Path(gpn_m_checkpoint + ".lm_eval.gpn_tiny_choice.json").read_text())
    assert saved["tasks"] == ["gpn_tiny_choice"] and saved["step"] == 7
    assert 0.0 <= saved["results"]["gpn_tiny_choice"]["acc,none"] <= 1.0


def test_the_startup_hook_imports_nothing_heavy() -> None:
    """The .pth runs the hook in every interpreter of the environment: it must stay cheap
    (no torch, no lm_eval) until lm_eval's registry is actually imported."""
    code = (
        "import sys, gpn_scale.eval.lm_eval_hook as h; "
        "heavy = [m for m in ('torch', 'lm_eval', 'numpy') if m in sys.modules]; "
        "assert not heavy, heavy; "
        "from lm_eval.api.registry import get_model; print(get_model('gpn_scale').__name__)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "GPNScaleLM"


def _offline_eval(tmp_path: Path, checkpoint: str, warm: bool) -> subprocess.CompletedProcess:
    """`gpn-scale eval --lm-eval hellaswag` on a node whose Hub is unreachable (HF_ENDPOINT at
    a closed local port), with an empty or an unrelated-but-warm HF cache."""
    home = tmp_path / "hf"
    if warm:
        (home / "hub" / "datasets--someone--else").mkdir(parents=True)
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    }
    env.update(HF_HOME=str(home), HF_ENDPOINT="http://127.0.0.1:9", PYTHONPATH=str(REPO))
    argv = ["eval", checkpoint, "--lm-eval", "hellaswag", "--device", "cpu"]
    return subprocess.run(
        [sys.executable, "-m", "gpn_scale", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_lm_eval_on_an_offline_node_is_one_line_at_once(tmp_path: Path, gpn_m_checkpoint: str):
    """It used to retry the Hub for over a minute and end in a 60-line traceback."""
    import time

    start = time.monotonic()
    proc = _offline_eval(tmp_path, gpn_m_checkpoint, warm=False)
    took = time.monotonic() - start
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("gpn-scale: error: --lm-eval hellaswag: the task data comes")
    assert "http://127.0.0.1:9 is not reachable" in lines[0] and "cache is empty" in lines[0]
    assert took < 60, took  # imports only: no retries, no task index
    assert not list(Path(gpn_m_checkpoint).parent.glob("*.lm_eval.*"))


@pytest.mark.slow
def test_lm_eval_offline_with_a_cache_that_lacks_the_task_is_one_line(
    tmp_path: Path, gpn_m_checkpoint: str
):
    proc = _offline_eval(tmp_path, gpn_m_checkpoint, warm=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "--lm-eval hellaswag: the task data could not be loaded" in lines[0]
    assert "not in the local cache" in lines[0]
