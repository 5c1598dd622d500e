"""Helpers for the tests on finished run folders (copied, moved, read-only, warm-started,
exported): a tiny `gpn-scale train` run made once per session, the CLI in a subprocess from
a chosen working directory, file snapshots and a read-only mount. (A uniquely named
module: `conftest` is ambiguous when several test directories are collected.)"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOTAL_STEPS = 2


def env(tmp: Path, **extra: str) -> dict[str, str]:
    """A child's environment: this checkout first on the path, one thread, a private TMPDIR."""
    out = dict(os.environ)
    (tmp / "tmp").mkdir(parents=True, exist_ok=True)
    out.update(
        {
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
            "TMPDIR": str(tmp / "tmp"),
            "PYTHONUNBUFFERED": "1",
        }
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        out.pop(key, None)
    out.update(extra)
    return out


def gpn(cwd: Path, *args: str, check: bool = True, timeout: float = 600, **extra: str):
    """`python -m gpn_scale ARGS` run from `cwd` (relative paths are the user's)."""
    proc = subprocess.run(
        [sys.executable, "-m", "gpn_scale", *args],
        cwd=cwd,
        env=env(cwd, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}: gpn-scale {' '.join(args)}\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-3000:]}"
        )
    return proc


def train(cwd: Path, run_dir: str, *overrides: str, flags: tuple[str, ...] = ()):
    """`gpn-scale train ci_tiny run_dir=RUN_DIR` for TOTAL_STEPS steps, a checkpoint at
    each, from `cwd` (the default corpus is built inside the run folder unless
    data.remote says otherwise)."""
    return gpn(
        cwd,
        "train",
        "ci_tiny",
        f"run_dir={run_dir}",
        f"schedule.total_steps={TOTAL_STEPS}",
        "schedule.warmup_steps=1",
        "checkpoint.every_steps=1",
        *overrides,
        *flags,
    )


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """relative path -> (size, mtime_ns) of every file and directory under `root`."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        out[path.relative_to(root).as_posix()] = (
            st.st_size if path.is_file() else 0,
            st.st_mtime_ns,
        )
    return out


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """`path` read-only for this block: a read-only bind mount where we may mount (root),
    else chmod -R a-w (an ordinary user cannot write through it either)."""
    if os.geteuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", str(path)], check=True)
        try:
            yield
        finally:
            subprocess.run(["chmod", "-R", "u+w", str(path)], check=True)
        return
    mounted = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot make {path} read-only as root without mount: {mounted.stderr!r}")
    try:
        ro = subprocess.run(
            ["mount", "-o", "remount,ro,bind", str(path)], capture_output=True, text=True
        )
        if ro.returncode != 0:
            pytest.skip(f"cannot remount {path} read-only: {ro.stderr.strip()}")
        probe = path / ".write-probe"
        with pytest.raises(OSError):
            probe.write_text("x")
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def copy_run(src: Path, dest: Path) -> Path:
    """`cp -r` a run folder (symlinks as they are, times kept)."""
    shutil.copytree(src, dest, symlinks=True)
    return dest
