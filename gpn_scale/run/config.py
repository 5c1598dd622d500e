"""The training run's configuration: a typed schema (dataclasses) loaded with OmegaConf.

`load_train_config(path, overrides)` reads a YAML file, applies `key=value` dotlist
overrides and returns a `TrainConfig`. Every key is checked against the schema *before*
OmegaConf merges it, so a misspelled key fails with one line naming the closest valid key
(OmegaConf's own error would name the dataclass, not the dotted path the user typed).

The sweep launcher relies on these exact keys: `model`, `seed`, `run_name`, `optim.lr`,
`schedule.warmup_steps`, `schedule.total_steps`, `data.remote`, `data.seq_len`,
`train.global_batch_size`, `checkpoint.root`, `logging.wandb.{project,group,job_type}`.

The schema is gpn_scale.run.config_schema, its checks gpn_scale.run.config_checks; this
module loads a config and writes it back out. The names callers use are importable from here.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

from gpn_scale.core.config import ConfigError, read_yaml, resolve_named_yaml
from gpn_scale.io import run_folder
from gpn_scale.io.run_folder import DEFAULT_CORPUS
from gpn_scale.run.config_checks import check_keys, check_numbers, validate
from gpn_scale.run.config_schema import (
    SECTION_TYPES,
    AnalysisSection,
    CheckpointSection,
    CompileSection,
    DataSection,
    DebugSection,
    EngineSection,
    EvalSection,
    LoggingSection,
    OptimSection,
    ParallelSection,
    PreemptionSection,
    ProfilingSection,
    ScheduleSection,
    TrainConfig,
    TrainSection,
    WandbSection,
    all_keys,
)

# What callers import from here (the schema and its checks live beside this module).
__all__ = [
    "DEFAULT_CORPUS",
    "AnalysisSection",
    "CheckpointSection",
    "CompileSection",
    "DataSection",
    "DebugSection",
    "EngineSection",
    "EvalSection",
    "LoggingSection",
    "OptimSection",
    "ParallelSection",
    "PreemptionSection",
    "ProfilingSection",
    "ScheduleSection",
    "TrainConfig",
    "TrainSection",
    "WandbSection",
    "all_keys",
    "batch_layout",
    "check_numbers",
    "config_help",
    "format_config_help",
    "load_train_config",
    "relocatable",
    "resolve_config_path",
    "to_yaml",
    "validate",
]

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "train"

# Keys that name a place on disk: a leading ~ is the user's home, as in a shell.
PATH_KEYS = (
    "model",
    "run_dir",
    "data.remote",
    "data.local_cache",
    "checkpoint.root",
    "logging.wandb.dir",
    "profiling.folder",
)


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's meaning: the comments on its line and the comment block just above it,
    read from the dataclass's source (the schema's own comments, so the help cannot drift)."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            comments[tok.start[0]] = text.split("(noqa", 1)[0].split("noqa:", 1)[0].strip()
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    out: dict[str, str] = {}
    previous_end = body.lineno
    for node in body.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            end = node.end_lineno or node.lineno
            above = [
                comments[n]
                for n in range(previous_end + 1, node.lineno)
                if n in comments and comments[n]
            ]
            inline = [comments[n] for n in range(node.lineno, end + 1) if comments.get(n)]
            out[node.target.id] = " ".join(above + inline)
        previous_end = node.end_lineno or node.lineno
    return out


def config_help(schema: type = TrainConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, meaning) of every key of the schema, in schema order:
    what `gpn-scale train --help-config` prints (no config is read, nothing is checked)."""
    rows: list[tuple[str, str, str, str]] = []
    meanings = _field_comments(schema)
    defaults = schema()
    for f in dataclasses.fields(schema):
        ftype = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        sub = SECTION_TYPES.get(ftype)
        if sub is not None:
            rows.extend(config_help(sub, f"{prefix}{f.name}."))
            continue
        value = getattr(defaults, f.name)
        default = "null" if value is None else repr(value) if isinstance(value, str) else value
        kind = str(ftype).replace("Union[bool, str]", "bool | str")
        rows.append((f"{prefix}{f.name}", kind, str(default), meanings.get(f.name, "")))
    return rows


def format_config_help() -> str:
    lines = [
        "Every key of the training config (configs/train/*.yaml; override any with key=value)."
        " Type, default, meaning; numbers are finite and never negative (0 = off where a key"
        " has an off).",
        "",
    ]
    section = None
    for key, kind, default, meaning in config_help():
        head = key.split(".")[0] if "." in key else ""
        if head != section:
            section = head
            if head:
                lines += ["", f"[{head}]"]
        lines.append(f"  {key}: {kind} = {default}")
        if meaning:
            lines.append(f"      {meaning}")
    return "\n".join(lines)


def resolve_config_path(name_or_path: str | Path) -> Path:
    return resolve_named_yaml(name_or_path, CONFIG_DIR, "training config")


def load_train_config(
    name_or_path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()
) -> TrainConfig:
    """YAML file (or configs/train/<name>.yaml, or None for the defaults) + dotlist overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    layers = []
    if name_or_path is not None:
        raw = _read_config_layer(name_or_path)
        check_keys(raw, TrainConfig)
        layers.append(OmegaConf.create(raw))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{item}: overrides are key=value (e.g. optim.lr=3e-4)")
    if overrides:
        try:
            dot = OmegaConf.from_dotlist(list(overrides))
        except OmegaConfBaseException as err:
            raise ConfigError(f"bad override: {str(err).splitlines()[0]}") from None
        check_keys(OmegaConf.to_container(dot, resolve=False), TrainConfig)
        layers.append(dot)
    base = OmegaConf.structured(TrainConfig)
    try:
        merged = OmegaConf.merge(base, *layers)
        cfg: TrainConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        # Type errors: OmegaConf names the key and the value; keep its first line.
        msg = str(err).splitlines()[0]
        key = getattr(err, "full_key", None)
        raise ConfigError(f"{key}: {msg}" if key else msg) from None
    expand_user_paths(cfg)
    validate(cfg)
    return cfg


def expand_user_paths(cfg: TrainConfig) -> None:
    """A leading ~ in a path key is the home directory (never a folder named ~)."""
    for key in PATH_KEYS:
        *parents, name = key.split(".")
        owner: Any = cfg
        for part in parents:
            owner = getattr(owner, part)
        value = getattr(owner, name)
        if isinstance(value, str) and value.startswith("~"):
            expanded = os.path.expanduser(value)
            if expanded.startswith("~"):  # ~user of an unknown user
                raise ConfigError(
                    f"{key}={value}: cannot expand {value.split('/')[0]} (no such user's home); "
                    "give the path in full"
                )
            setattr(owner, name, expanded)


def _read_config_layer(name_or_path: str | Path) -> dict[str, Any]:
    """A training YAML's mapping; a run folder (or the config.yaml a run wrote in it) is
    its recorded config with the paths resolved for where the folder lies now
    (io/run_folder.py), so `gpn-scale eval runs/x` and `train runs/x` read runs/x."""
    shipped = "/" not in str(name_or_path) and (CONFIG_DIR / f"{name_or_path}.yaml").is_file()
    if run_folder.is_run_folder(name_or_path) and not shipped:  # a shipped name wins
        return run_folder.read_run_config(name_or_path)
    path = resolve_config_path(name_or_path)
    raw = read_yaml(path, resolve=False, what="training config")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of config sections")
    if path.name == run_folder.RUN_CONFIG and raw.get("run_dir") == run_folder.HERE:
        return run_folder.rebase_run_config(raw, str(path.parent))
    return raw


def batch_layout(cfg: TrainConfig, world_size: int) -> tuple[int, int]:
    """(micro batch per rank, gradient-accumulation steps) for this world size.

    global_batch_size = micro * accum * world; a split that does not divide fails clearly.
    """
    gbs = cfg.train.global_batch_size
    if gbs % world_size:
        raise ConfigError(
            f"train.global_batch_size: {gbs} is not divisible by the world size {world_size}"
        )
    per_rank = gbs // world_size
    micro = cfg.train.micro_batch_size or per_rank
    if per_rank % micro:
        raise ConfigError(
            f"train.micro_batch_size: {micro} does not divide the per-rank batch "
            f"{per_rank} (= global_batch_size {gbs} / world size {world_size})"
        )
    return micro, per_rank // micro


def to_yaml(cfg: TrainConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def relocatable(cfg: TrainConfig) -> TrainConfig:
    """The config as a run records it (config.yaml, every checkpoint's meta): defaults
    filled in, its run folder as `.` and every path inside it relative to it."""
    run_dir = cfg.resolved_run_dir
    out = copy.deepcopy(cfg)
    out.run_dir = run_folder.HERE
    out.checkpoint.root = run_folder.to_run_relative(cfg.resolved_checkpoint_root, run_dir)
    if cfg.data.remote != DEFAULT_CORPUS:
        out.data.remote = str(run_folder.to_run_relative(cfg.data.remote, run_dir))
    out.data.local_cache = run_folder.to_run_relative(cfg.data.local_cache, run_dir)
    out.logging.wandb.dir = run_folder.to_run_relative(cfg.logging.wandb.dir, run_dir)
    out.profiling.folder = run_folder.to_run_relative(cfg.profiling.folder, run_dir)
    if run_folder.looks_like_path(cfg.model) and Path(cfg.model).is_file():
        out.model = str(run_folder.to_run_relative(cfg.model, run_dir))
    return out
