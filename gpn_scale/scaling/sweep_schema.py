"""The sweep file's schema: its keys, the checks of their values (each fault one line naming
the key and the fix), and its sweep-wide sections (name, seeds, base_config, data and storage
roots, W&B, checkpoint cadence, hardware) read into the `Sections` every run shares. The
file's format: sweep.py's docstring, which expands each `models` entry into runs."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpn_scale.core.config import closest_key_hint
from gpn_scale.scaling.sweep_price import accounting_gpu
from gpn_scale.scaling.sweep_spec import SweepError

REPO_ROOT = Path(__file__).resolve().parents[2]
MIN_SEEDS = 3
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

TOP_KEYS = (
    "name",
    "description",
    "seeds",
    "allow_few_seeds",
    "base_config",
    "data",
    "checkpoint_root",
    "run_root",
    "checkpoint_every_steps",
    "wandb",
    "hardware",
    "defaults",
    "models",
)
DATA_KEYS = ("remote", "seq_len")
WANDB_KEYS = ("project", "group", "job_type", "mode")
WANDB_MODES = ("online", "offline", "auto", "disabled")
# Without checkpoint_every_steps a run checkpoints every 1/20 of its steps: a node failure
# or an NCCL abort loses at most 5% of the run.
DEFAULT_CHECKPOINTS_PER_RUN = 20
HARDWARE_KEYS = ("gpu", "peak_tflops", "mfu", "sequences_per_gpu")
RULE_KEYS = (
    "tokens_per_param",
    "tokens",
    "global_batch_size",
    "lr",
    "warmup_steps",
    "min_lr_ratio",
    "overrides",
)
MODEL_KEYS = ("config", "name", "family", "model_overrides") + RULE_KEYS
REQUIRED_RULES = ("global_batch_size", "lr", "warmup_steps")


# ----------------------------------------------------------------------------- values


def check_keys(where: str, values: Mapping[str, Any], valid: Sequence[str]) -> None:
    for key in values:
        if key not in valid:
            raise SweepError(f"{where}{key}: unknown key{closest_key_hint(str(key), list(valid))}")


def as_mapping(where: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SweepError(f"{where}: expected a mapping, got {value!r}")
    return dict(value)


def positive_int(where: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SweepError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def positive_float(where: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise SweepError(f"{where}: expected a positive number, got {value!r}")
    return float(value)


def _storage(where: str, value: Any, allow_default: bool = False) -> str:
    """An s3://bucket/prefix or a local path (the trainer's "default" corpus if allowed)."""
    if not isinstance(value, str) or not value.strip():
        raise SweepError(f"{where}: required; give an s3://bucket/prefix or a local path")
    value = value.strip()
    if allow_default and value == "default":
        return value
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", value)
    if m:
        scheme, rest = m.group(1).lower(), m.group(2)
        if scheme == "file":
            return rest
        if scheme != "s3":
            raise SweepError(
                f"{where}: unsupported scheme '{scheme}://' in {value!r}; use s3:// or a local path"
            )
        if (
            not rest
            or rest.startswith("/")
            or not re.match(r"^[a-z0-9][a-z0-9.-]{1,62}(/|$)", rest)
        ):
            raise SweepError(
                f"{where}: {value!r} is not s3://<bucket>/<prefix> (bucket names "
                "are 3-63 lowercase letters, digits, dots and dashes)"
            )
    return value.rstrip("/") or value


def _beside(sweep_path: Path, value: str) -> str:
    """A relative local path is taken from the sweep file's directory (as model config paths
    are), never from wherever a job happens to start; s3:// and `default` stay as they are."""
    if value == "default" or "://" in value or Path(value).is_absolute():
        return value
    return str((sweep_path.resolve().parent / value).resolve())


# ----------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class Sections:
    """The sweep-wide sections, validated: what every run of the sweep shares."""

    name: str
    path: Path
    seeds: list[int]
    notes: list[str]
    base_config: str | None
    data_remote: str
    seq_len: int
    ckpt_root: str
    run_root: str | None
    project: str
    group: str
    job_type: str
    wandb_mode: str
    every: int | None  # checkpoint_every_steps; None: every 5% of each run
    hardware: dict[str, Any]  # as `plan` reports it (the predicted MFUs are added)
    peak: float
    seqs_per_gpu: int
    mfu: float  # the measured fraction (unused under `mfu: predicted`)
    predicted_gpu: str | None  # the accounting's GPU under `mfu: predicted`


def read_sections(raw: dict[str, Any], path: Path, allow_few_seeds: bool) -> Sections:
    """The top-level keys, the name, seeds, base_config, data and storage roots, W&B and the
    checkpoint cadence, and the hardware that prices the runs."""
    check_keys("", raw, TOP_KEYS)
    name = raw.get("name")
    if not isinstance(name, str) or not RUN_NAME_RE.match(name):
        raise SweepError(
            f"name: required, letters/digits/._- only (it prefixes run names), got {name!r}"
        )
    seeds, notes = _read_seeds(raw, allow_few_seeds)
    base_config = raw.get("base_config")
    if base_config is not None:
        if not isinstance(base_config, str):
            raise SweepError(
                f"base_config: expected a train config name or path, got {base_config!r}"
            )
        base_config = _resolve_train_config(base_config, path)
    data_remote, seq_len, ckpt_root, run_root = _read_storage(raw, path)
    project, group, job_type, wandb_mode, every = _read_logging(raw, name)
    hardware, peak, seqs_per_gpu, mfu, predicted_gpu = _read_hardware(raw)
    return Sections(
        name=name,
        path=path,
        seeds=seeds,
        notes=notes,
        base_config=base_config,
        data_remote=data_remote,
        seq_len=seq_len,
        ckpt_root=ckpt_root,
        run_root=run_root,
        project=project,
        group=group,
        job_type=job_type,
        wandb_mode=wandb_mode,
        every=every,
        hardware=hardware,
        peak=peak,
        seqs_per_gpu=seqs_per_gpu,
        mfu=mfu,
        predicted_gpu=predicted_gpu,
    )


def _read_seeds(raw: dict[str, Any], allow_few_seeds: bool) -> tuple[list[int], list[str]]:
    """`seeds` (a list or a count) and the note a sweep with fewer than MIN_SEEDS gets."""
    seeds_raw = raw.get("seeds")
    if isinstance(seeds_raw, int) and not isinstance(seeds_raw, bool):
        seeds = list(range(positive_int("seeds", seeds_raw)))
    elif isinstance(seeds_raw, list) and seeds_raw:
        seeds = [positive_int(f"seeds[{i}]", s, minimum=0) for i, s in enumerate(seeds_raw)]
        if len(set(seeds)) != len(seeds):
            dup = next(s for s in seeds if seeds.count(s) > 1)
            raise SweepError(f"seeds: seed {dup} is listed twice; list distinct seeds")
    else:
        raise SweepError(f"seeds: required, a list of integers or a count, got {seeds_raw!r}")
    few_ok = raw.get("allow_few_seeds", False)
    if not isinstance(few_ok, bool):
        raise SweepError(f"allow_few_seeds: expected true or false, got {few_ok!r}")
    notes = []
    if len(seeds) < MIN_SEEDS:
        if not (few_ok or allow_few_seeds):
            raise SweepError(
                f"seeds: {len(seeds)} seed(s) but a sweep needs >= {MIN_SEEDS} for "
                "seed-bootstrap CIs; add seeds (or set allow_few_seeds: true for a "
                "CI/smoke sweep)"
            )
        notes.append(
            f"only {len(seeds)} seed(s) (< {MIN_SEEDS}): allowed by allow_few_seeds, "
            "for CI/smoke sweeps only; fits from it have no meaningful CIs"
        )
    return seeds, notes


def _read_storage(raw: dict[str, Any], path: Path) -> tuple[str, int, str, str | None]:
    """data.remote, data.seq_len, checkpoint_root and run_root (relative local paths taken
    from the sweep file's directory)."""
    data = as_mapping("data", raw.get("data"))
    check_keys("data.", data, DATA_KEYS)
    data_remote = _beside(path, _storage("data.remote", data.get("remote"), allow_default=True))
    seq_len = positive_int("data.seq_len", data.get("seq_len", 2048))
    ckpt_root = _beside(path, _storage("checkpoint_root", raw.get("checkpoint_root")))
    run_root = raw.get("run_root")
    if run_root is not None:
        if not isinstance(run_root, str) or "://" in run_root:
            raise SweepError(f"run_root: expected a local directory, got {run_root!r}")
        run_root = _beside(path, run_root.rstrip("/") or "/")
    return data_remote, seq_len, ckpt_root, run_root


def _read_logging(raw: dict[str, Any], name: str) -> tuple[str, str, str, str, int | None]:
    """How the runs report and save: wandb's project, group (default: the sweep's name),
    job_type and mode, and checkpoint_every_steps (checked between wandb's keys)."""
    wandb = as_mapping("wandb", raw.get("wandb"))
    check_keys("wandb.", wandb, WANDB_KEYS)
    project = wandb.get("project")
    if not isinstance(project, str) or not project:
        raise SweepError("wandb.project: required, the W&B project name")
    group = wandb.get("group") or name
    wandb_mode = wandb.get("mode", "auto")
    if wandb_mode not in WANDB_MODES:
        raise SweepError(f"wandb.mode: one of {', '.join(WANDB_MODES)}, got {wandb_mode!r}")
    every_raw = raw.get("checkpoint_every_steps")
    every = None
    if every_raw is not None:
        every = positive_int("checkpoint_every_steps", every_raw, minimum=0)
    job_type = wandb.get("job_type") or "scaling"
    for key, val in (("group", group), ("job_type", job_type)):
        if not isinstance(val, str):
            raise SweepError(f"wandb.{key}: expected a string, got {val!r}")
    return project, group, job_type, wandb_mode, every


def _read_hardware(raw: dict[str, Any]) -> tuple[dict[str, Any], float, int, float, str | None]:
    """`hardware` over its defaults: the peak, sequences per GPU, and a measured MFU or the
    GPU the launch accounting predicts one for."""
    hardware: dict[str, Any] = {
        "gpu": "H100-SXM",
        "peak_tflops": 989.0,
        "mfu": "predicted",
        "sequences_per_gpu": 16,
    }
    hw = as_mapping("hardware", raw.get("hardware"))
    check_keys("hardware.", hw, HARDWARE_KEYS)
    hardware.update(hw)
    peak = positive_float("hardware.peak_tflops", hardware["peak_tflops"])
    seqs_per_gpu = positive_int("hardware.sequences_per_gpu", hardware["sequences_per_gpu"])
    if hardware["mfu"] == "predicted":
        return hardware, peak, seqs_per_gpu, 0.0, accounting_gpu(str(hardware["gpu"]))
    mfu = positive_float("hardware.mfu", hardware["mfu"])
    if mfu > 1:
        raise SweepError(f"hardware.mfu: a fraction in (0, 1] or 'predicted', got {mfu}")
    return hardware, peak, seqs_per_gpu, mfu, None


def _resolve_train_config(name: str, sweep_path: Path) -> str:
    if Path(name).suffix in (".yaml", ".yml"):
        p = Path(name)
        if not p.is_absolute():
            p = (sweep_path.parent / p).resolve()
        if not p.is_file():
            raise SweepError(f"base_config: {p} not found")
        return str(p)
    train_dir = REPO_ROOT / "configs" / "train"
    if not (train_dir / f"{name}.yaml").is_file():
        names = sorted(q.stem for q in train_dir.glob("*.yaml"))
        raise SweepError(
            f"base_config: '{name}' not found in {train_dir}{closest_key_hint(name, names)}"
        )
    return name
