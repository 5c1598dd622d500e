"""How a run folder records paths, so that a copied or moved folder is still itself.

Everything a run writes into its folder or its checkpoints names locations in one of two
ways: relative to the run folder when they lie inside it (the default checkpoint root, the
embedded default corpus, the data cache), absolute (or an s3:// URI) when they point outside
it. Readers resolve the relative ones against the folder they were given, never against the
current directory, so `cp -r runs/a runs/b; gpn-scale eval runs/b ...` reads `runs/b`.

    <run>/config.yaml       run_dir: .   checkpoint.root: checkpoints   data.remote: /abs/data
    <root>/DONE             "checkpoint": "step_000000200", "run_dir": ".."   (relative to <root>)
    <root>/step_N manifest  meta.run_dir: ".." (relative to <root>), meta.config as config.yaml

Files written before this rule (paths relative to the launch directory) are read as well:
a path under the recorded run_dir is moved onto the folder actually given.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path
from typing import Any

# The sentinel for data.remote: build the embedded default corpus (byte-level) locally. A
# name, not a path, so never rebased (the train config's data.remote default).
DEFAULT_CORPUS = "default"

# Every file name and marker of a run folder and of a checkpoint root is spelled here once
# (tests/io/test_run_folder.py holds that no other module spells them).
RUN_CONFIG = "config.yaml"  # the run's resolved config
METRICS = "metrics.jsonl"  # the run's history: one JSON object per line
LOSS_CURVE = "loss_curve.png"  # gpn-scale demo's plot
FINAL_WEIGHTS = "model_final.pt"  # checkpoint.export_final: the final weights, one file
CHECKPOINTS = "checkpoints"  # the default checkpoint root, inside the run folder
# The embedded default corpus, built under the run folder: data/default_corpus_T<seq_len>.
CORPUS_DIR = "data"
DEFAULT_CORPUS_PREFIX = "default_corpus_T"
# A checkpoint root: step folders (each complete once its manifest is written, last), the
# pointer to the newest, and the marker a finished run leaves.
MANIFEST = "manifest.json"
LATEST = "latest"
DONE = "DONE"
STEP_DIR_RE = re.compile(r"^step_(\d{9,})$")
HERE = "."  # config.yaml's run_dir: the folder holding it


def default_corpus_dir(run_dir: str | Path, seq_len: Any) -> Path:
    """Where a run builds the embedded default corpus of windows of `seq_len` tokens."""
    return Path(run_dir) / CORPUS_DIR / f"{DEFAULT_CORPUS_PREFIX}{seq_len}"


def is_default_corpus(path: str) -> bool:
    """Whether `path` names a folder `default_corpus_dir` gives (of any run, any length)."""
    return str(path).rstrip("/").rsplit("/", 1)[-1].startswith(DEFAULT_CORPUS_PREFIX)


def step_dir_name(step: int) -> str:
    """`step_000000200`: zero-padded so lexical and numeric order agree."""
    return f"step_{int(step):09d}"


def step_of(name: str) -> int | None:
    """The step a step folder's name (or a path or URI ending in one) says; None for any
    other name. The one parser of step folder names."""
    match = STEP_DIR_RE.match(str(name).rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def _is_uri(path: str) -> bool:
    return "://" in path


def _abs(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def to_run_relative(path: str | None, run_dir: str) -> str | None:
    """`path` as a run records it: relative (posix) when it lies inside `run_dir`,
    absolute otherwise; URIs and None unchanged."""
    if path is None or _is_uri(str(path)):
        return path
    full, base = _abs(str(path)), _abs(run_dir)
    if full == base:
        return HERE
    if full.startswith(base.rstrip(os.sep) + os.sep):
        return Path(os.path.relpath(full, base)).as_posix()
    return full


def from_run_relative(path: str | None, run_dir: str) -> str | None:
    """The location a recorded `path` names for the run folder `run_dir`."""
    if path is None or _is_uri(str(path)) or os.path.isabs(os.path.expanduser(str(path))):
        return None if path is None else os.path.expanduser(str(path))
    if path == HERE:
        return str(run_dir)
    return str(Path(run_dir) / path)


def looks_like_path(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) or "/" in name


# Keys of a run's config.yaml that hold local paths (run_dir itself aside).
_PATH_KEYS = (
    ("checkpoint", "root"),
    ("data", "remote"),
    ("data", "local_cache"),
    ("logging", "wandb", "dir"),
    ("profiling", "folder"),
    ("model",),
)


def _get(raw: dict[str, Any], keys: tuple[str, ...]) -> Any:
    value: Any = raw
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _set(raw: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    node = raw
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value


def rebase_run_config(raw: dict[str, Any], folder: str) -> dict[str, Any]:
    """A run's recorded config (config.yaml or a manifest's meta.config, as plain
    containers) with its paths resolved for the run folder `folder` (where it lies now).

    Recorded with run_dir `.`: relative paths are the folder's. Older records (run_dir as
    the launch gave it): a path under that run_dir moves onto `folder`; others stay."""
    out = copy.deepcopy(raw)
    recorded = raw.get("run_dir")
    out["run_dir"] = str(folder)
    if recorded is None:  # the default runs/<run_name> of the launch directory
        recorded = str(Path("runs") / str(raw.get("run_name") or "run"))
    if _get(raw, ("checkpoint", "root")) is None:  # the default layout
        _set(out, ("checkpoint", "root"), str(Path(folder) / CHECKPOINTS))
    for keys in _PATH_KEYS:
        value = _get(raw, keys)
        if not isinstance(value, str) or _is_uri(value) or value == DEFAULT_CORPUS:
            continue
        if keys == ("model",) and not looks_like_path(value):
            continue
        if recorded == HERE:
            _set(out, keys, from_run_relative(value, folder))
            continue
        old = os.path.normpath(str(recorded))
        norm = os.path.normpath(value)
        if norm == old or norm.startswith(old.rstrip(os.sep) + os.sep):
            _set(out, keys, str(Path(folder) / os.path.relpath(norm, old)))
    return out


def is_run_folder(path: str | Path) -> bool:
    """A local directory holding the config.yaml a run wrote."""
    return "://" not in str(path) and (Path(path) / RUN_CONFIG).is_file()


def read_run_config(folder: str | Path) -> dict[str, Any]:
    """config.yaml of the run folder `folder`, its paths resolved for where it lies now.

    An empty or unreadable config.yaml (truncated by a crash or a copy) is never read as the
    schema's defaults (another dataset, another seq_len): the config the run's newest
    checkpoint recorded (its manifest's meta.config) stands in, said in one line on stderr;
    without one, one ConfigError line naming the file and the fix."""
    from gpn_scale.core.config import ConfigError, read_yaml

    path = Path(folder) / RUN_CONFIG
    try:
        raw = read_yaml(path, resolve=False, what="run config")
        why = f"{path} is empty" if not raw else f"{path}: not a mapping of config sections"
    except ConfigError as err:
        raw, why = None, str(err)
    if isinstance(raw, dict) and raw:
        return rebase_run_config(raw, str(folder))
    recorded, manifest = _recorded_config(Path(folder) / CHECKPOINTS)
    if recorded is None:
        raise ConfigError(
            f"{why}, and no checkpoint in {Path(folder) / CHECKPOINTS} records the run's "
            "config; restore config.yaml (e.g. from a copy of the run), or give the training "
            "config in its place (gpn-scale eval CONFIG run_dir=... checkpoint.root=...)"
        )
    if str(path) not in _SAID:
        _SAID.add(str(path))
        print(
            f"gpn-scale: warning: {why}; using the config recorded in {manifest}", file=sys.stderr
        )
    return rebase_run_config(recorded, str(folder))


_SAID: set[str] = set()  # the config.yaml files a line already named (one line a process)


def _recorded_config(root: Path) -> tuple[dict[str, Any] | None, str]:
    """(meta.config, its manifest) of the newest checkpoint under `root` that records one."""
    import json

    steps = [p for p in root.glob("step_*") if step_of(p.name) is not None] if root.is_dir() else []
    for step in sorted(steps, key=lambda p: step_of(p.name) or 0, reverse=True):
        manifest = step / MANIFEST
        try:
            config = json.loads(manifest.read_bytes()).get("meta", {}).get("config")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(config, dict) and config:
            return config, str(manifest)
    return None, ""


def checkpoint_run_dir(step_uri: str, meta: dict[str, Any]) -> str | None:
    """The run folder of a checkpoint: its manifest's `run_dir` (relative to the checkpoint
    root, or absolute); for older checkpoints of the default layout, the root's parent."""
    root = step_uri.rstrip("/").rsplit("/", 1)[0]
    recorded = meta.get("run_dir")
    if isinstance(recorded, str) and recorded:
        if _is_uri(recorded) or os.path.isabs(recorded):
            return recorded
        if _is_uri(root):
            return None  # relative to an S3 root: no local folder to name
        return os.path.normpath(str(Path(root) / recorded))
    config = meta.get("config") or {}
    ckpt = (config.get("checkpoint") or {}).get("root") if isinstance(config, dict) else None
    if ckpt is None and not _is_uri(root):
        return str(Path(root).parent)
    run_dir = config.get("run_dir") if isinstance(config, dict) else None
    return str(run_dir) if run_dir else None


def record_run_dir(run_dir: str, checkpoint_root: str) -> str:
    """The run folder as a checkpoint root's files record it (DONE, manifests): relative to
    the root when both are local (`..` for the default layout), else absolute."""
    if _is_uri(checkpoint_root):
        return _abs(run_dir)
    return Path(os.path.relpath(_abs(run_dir), _abs(checkpoint_root))).as_posix()


def resolve_recorded(value: str | None, base: str) -> str | None:
    """A path recorded relative to `base` (a directory or s3:// prefix) made usable."""
    if not value or _is_uri(value) or os.path.isabs(value):
        return value
    if _is_uri(base):
        return f"{base.rstrip('/')}/{value}"
    return os.path.normpath(str(Path(base) / value))


def missing_tops(paths: list[str | Path | None]) -> list[Path]:
    """For each local path, its topmost ancestor that does not exist yet (what creating it
    would add); nothing for paths that exist, S3 URIs and None."""
    out: list[Path] = []
    for path in paths:
        if not path or "://" in str(path):
            continue
        p = Path(os.path.abspath(os.path.expanduser(str(path))))
        top = None
        while not p.exists() and p != p.parent:
            top, p = p, p.parent
        if top is not None and top not in out:
            out.append(top)
    return out
