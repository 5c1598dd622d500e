"""Sweep files: a grid of model sizes x seeds with per-size rules, expanded into runs.

A sweep file (`configs/sweeps/*.yaml`, OmegaConf YAML) looks like

    name: gpn-ladder                 # prefix of every run name; default W&B group
    seeds: [0, 1, 2]                 # or a count (3 -> 0, 1, 2); >= 3 unless allow_few_seeds
    allow_few_seeds: false           # true only for CI/smoke sweeps
    base_config: null                # configs/train/<name>.yaml the runs start from
    data: {remote: s3://bucket/mds, seq_len: 2048}
    checkpoint_root: s3://bucket/ckpt/gpn-ladder   # run r checkpoints (and DONE) in <root>/<r>
    run_root: null                   # local run dirs (metrics.jsonl) in <run_root>/<r>
    # relative local paths (data.remote, checkpoint_root, run_root, model .yaml paths) are
    # taken from the sweep file's directory
    wandb: {project: gpn-scale, group: null, job_type: scaling, mode: auto}
                                     # mode: online | offline | auto (online, else offline
                                     # with the `wandb sync` command logged) | disabled
    checkpoint_every_steps: 500      # periodic checkpoints; absent: every 5% of each run
                                     # (ceil(total_steps / 20)); 0: only preemption/end
    hardware: {gpu: H100-SXM, peak_tflops: 989, mfu: predicted, sequences_per_gpu: 16}
                                   # GPU-hours: mfu a measured fraction (docs/perf.md), or
                                   # "predicted" by gpn_scale.accounting.gpu_model per model size
    defaults:                        # rules every size uses unless it overrides them
      tokens_per_param: 20           # or tokens: 2.6e9 (one of the two; a list = several D)
      global_batch_size: 128         # sequences per optimizer step
      lr: 6.0e-4
      warmup_steps: 100
      min_lr_ratio: 0.1
      overrides: []                  # extra `key=value` for the trainer, passed verbatim
    models:
      - {config: gpn_m_25m, lr: 1.0e-3}
      - {config: gpn_m_130m, family: gpn+m}
      - {config: tiny, name: tiny-f448, model_overrides: {d_ffn: 448}}   # a size variant

`model_overrides` changes fields of that model's config (validated, and counted, with its own
family's config class) and reaches the trainer as `model_overrides.<field>=<value>`.

`expand_sweep(path)` validates everything and returns one `RunSpec` per (size, token
budget, seed); `RunSpec.train_overrides()` is the dotlist for `gpn-scale train`.
Every error is one line naming the key and the fix (`SweepError`, a ConfigError).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpn_scale.core.config import ConfigError, closest_key_hint, read_yaml, resolve_named_yaml
from gpn_scale.models.registry import family_of, get_family, titles_where

REPO_ROOT = Path(__file__).resolve().parents[2]
SWEEP_DIR = REPO_ROOT / "configs" / "sweeps"
MIN_SEEDS = 3
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class SweepError(ConfigError):
    """A sweep file is invalid; the message names the key and the fix."""


# ----------------------------------------------------------------------------- schema

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


@dataclass(frozen=True)
class RunSpec:
    """Everything one training run of a sweep needs, plus what `plan` reports about it."""

    name: str
    sweep: str
    family: str  # the label fits compare (gpn_scale.scaling.families.family_label)
    registry_family: str  # the FamilySpec that builds it ("gpn", "transformer_pp", ...)
    size: str  # the size's label (default: model config name)
    model: str  # model config name (configs/model/<model>.yaml) or a path
    seed: int
    params: int  # all parameters, embedding included
    tokens: int  # steps * global_batch_size * seq_len
    tokens_per_param: float
    total_steps: int
    global_batch_size: int  # sequences per optimizer step
    seq_len: int
    lr: float
    warmup_steps: int
    min_lr_ratio: float | None
    data_remote: str
    checkpoint_root: str  # this run's own checkpoint prefix: <sweep root>/<name>
    run_dir: str | None  # this run's local dir (metrics.jsonl), when run_root is set
    wandb_project: str
    wandb_group: str
    wandb_job_type: str
    flops: float  # training FLOPs (3 x forward) for `tokens`
    gpu_hours: float  # flops / (peak * mfu)
    base_config: str | None = None
    extra_overrides: tuple[str, ...] = ()
    model_overrides: tuple[tuple[str, Any], ...] = ()  # (field, value) of the model config
    checkpoint_every_steps: int = 0
    wandb_mode: str = "auto"

    @property
    def wandb_run_id(self) -> str:
        """One W&B run per sweep run, the same across requeues and re-submissions (even
        before the first checkpoint records it): the run name plus a hash of sweep + name."""
        import hashlib
        import re as _re

        digest = hashlib.sha1(f"{self.sweep}/{self.name}".encode()).hexdigest()[:10]
        return f"{_re.sub(r'[^A-Za-z0-9_-]', '-', self.name)[:50]}-{digest}"

    def train_overrides(self) -> list[str]:
        """OmegaConf dotlist overrides for `gpn-scale train [base_config] <overrides>`."""
        out = [
            f"model={self.model}",
            f"seed={self.seed}",
            f"run_name={self.name}",
            f"optim.lr={self.lr!r}",
            f"schedule.warmup_steps={self.warmup_steps}",
            f"schedule.total_steps={self.total_steps}",
            f"data.remote={self.data_remote}",
            f"data.seq_len={self.seq_len}",
            f"train.global_batch_size={self.global_batch_size}",
            f"checkpoint.root={self.checkpoint_root}",
            f"logging.wandb.project={self.wandb_project}",
            f"logging.wandb.group={self.wandb_group}",
            f"logging.wandb.job_type={self.wandb_job_type}",
            f"logging.wandb.mode={self.wandb_mode}",
            f"logging.wandb.run_id={self.wandb_run_id}",
            f"checkpoint.every_steps={self.checkpoint_every_steps}",
        ]
        out += [f"model_overrides.{k}={_dotlist_value(v)}" for k, v in self.model_overrides]
        if self.min_lr_ratio is not None:
            out.append(f"schedule.min_lr_ratio={self.min_lr_ratio!r}")
        if self.run_dir is not None:
            out.append(f"run_dir={self.run_dir}")
        return out + list(self.extra_overrides)

    def train_argv(self) -> list[str]:
        """`gpn-scale train` arguments: the base config (when any) then the overrides."""
        return ([self.base_config] if self.base_config else []) + self.train_overrides()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["extra_overrides"] = list(self.extra_overrides)
        d["model_overrides"] = dict(self.model_overrides)
        d["train_overrides"] = self.train_overrides()
        return d


@dataclass
class Sweep:
    name: str
    path: Path
    runs: list[RunSpec]
    seeds: list[int]
    hardware: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    description: str = ""

    @property
    def total_gpu_hours(self) -> float:
        return sum(r.gpu_hours for r in self.runs)

    @property
    def total_flops(self) -> float:
        return sum(r.flops for r in self.runs)


# ----------------------------------------------------------------------------- helpers


def resolve_sweep_path(name_or_path: str | Path) -> Path:
    return resolve_named_yaml(name_or_path, SWEEP_DIR, "sweep", SweepError)


def _check_keys(where: str, values: Mapping[str, Any], valid: Sequence[str]) -> None:
    for key in values:
        if key not in valid:
            raise SweepError(f"{where}{key}: unknown key{closest_key_hint(str(key), list(valid))}")


def _mapping(where: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SweepError(f"{where}: expected a mapping, got {value!r}")
    return dict(value)


def _positive_int(where: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SweepError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _positive_float(where: str, value: Any) -> float:
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


def _dotlist_value(value: Any) -> str:
    """A model field's value as OmegaConf's dotlist parses it back (null, true, 1e-05, ...)."""
    import json

    return "null" if value is None else json.dumps(value) if isinstance(value, bool) else str(value)


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def _token_label(rules: Mapping[str, Any], value: float) -> str:
    if "tokens_per_param" in rules:
        return f"tpp{value:g}"
    return f"d{_short(value)}"


def _short(x: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


# ----------------------------------------------------------------------------- loading


def load_sweep(
    name_or_path: str | Path, *, allow_few_seeds: bool = False, price: bool = True
) -> Sweep:
    """Read, validate and expand a sweep file (by path or by name in configs/sweeps/).
    `price`: compute the GPU-hours (with `mfu: predicted`, ~1 s per model size of launch
    accounting); callers that only need the runs (array tasks, fits) pass False."""
    path = resolve_sweep_path(name_or_path).resolve()  # plans and jobs print it absolute
    try:
        raw = read_yaml(path, what="sweep")
    except ConfigError as err:  # YAML syntax (file and line) or interpolation errors
        raise SweepError(str(err)) from None
    if not isinstance(raw, dict):
        raise SweepError(f"{path}: expected a mapping at the top level")
    return _expand(
        {str(k): v for k, v in raw.items()}, path, allow_few_seeds=allow_few_seeds, price=price
    )


_ACCOUNTING_GPUS = {"h100": "h100", "h100-sxm": "h100", "h100 sxm": "h100", "h200": "h200"}


def _accounting_gpu(name: str) -> str:
    key = _ACCOUNTING_GPUS.get(name.strip().lower())
    if key is None:
        raise SweepError(
            f"hardware.gpu: {name!r} has no launch accounting (H100-SXM, H200); "
            "give a measured hardware.mfu (a fraction) for it"
        )
    return key


@functools.cache
def _predicted_mfu(cfg: Any, sequences_per_gpu: int, seq_len: int, gpu: str, tp: int = 1) -> float:
    # The accounting runs the engine's CUDA code path on meta tensors (accounting/gpu_model.py);
    # under tp, accounting/tp_model.py's speed-up on one 8-GPU node.
    from gpn_scale.accounting.tp_model import predicted_mfu_at_tp

    try:
        return predicted_mfu_at_tp(cfg, sequences_per_gpu, seq_len, gpu, tp)
    except ValueError as err:
        raise SweepError(f"hardware.mfu: 'predicted': {err}; give a measured fraction") from None


@functools.cache
def _pricing_basis(gpu: str) -> str:
    # The calibrated accounting names what it rests on: the ceilings a committed device run
    # measured, the kernels it recorded (accounting/ceilings.py, docs/device-runs).
    from gpn_scale.accounting.step_model import pricing_basis

    return pricing_basis(gpu)


def _tp_override(overrides: list[str]) -> int:
    """The `parallel.tp=N` among a size's overrides (checked by _check_tp_override), else 1."""
    tp = 1
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() == "parallel.tp":
            tp = int(value)
    return tp


def expand_sweep(name_or_path: str | Path, *, allow_few_seeds: bool = False) -> list[RunSpec]:
    """The runs of a sweep file, validated (see module docstring)."""
    return load_sweep(name_or_path, allow_few_seeds=allow_few_seeds).runs


def _expand(raw: dict[str, Any], path: Path, *, allow_few_seeds: bool, price: bool = True) -> Sweep:
    from gpn_scale.scaling.families import model_facts

    _check_keys("", raw, TOP_KEYS)
    name = raw.get("name")
    if not isinstance(name, str) or not RUN_NAME_RE.match(name):
        raise SweepError(
            f"name: required, letters/digits/._- only (it prefixes run names), got {name!r}"
        )

    # seeds
    seeds_raw = raw.get("seeds")
    if isinstance(seeds_raw, int) and not isinstance(seeds_raw, bool):
        seeds = list(range(_positive_int("seeds", seeds_raw)))
    elif isinstance(seeds_raw, list) and seeds_raw:
        seeds = [_positive_int(f"seeds[{i}]", s, minimum=0) for i, s in enumerate(seeds_raw)]
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

    base_config = raw.get("base_config")
    if base_config is not None:
        if not isinstance(base_config, str):
            raise SweepError(
                f"base_config: expected a train config name or path, got {base_config!r}"
            )
        base_config = _resolve_train_config(base_config, path)

    data = _mapping("data", raw.get("data"))
    _check_keys("data.", data, DATA_KEYS)
    data_remote = _beside(path, _storage("data.remote", data.get("remote"), allow_default=True))
    seq_len = _positive_int("data.seq_len", data.get("seq_len", 2048))
    ckpt_root = _beside(path, _storage("checkpoint_root", raw.get("checkpoint_root")))
    run_root = raw.get("run_root")
    if run_root is not None:
        if not isinstance(run_root, str) or "://" in run_root:
            raise SweepError(f"run_root: expected a local directory, got {run_root!r}")
        run_root = _beside(path, run_root.rstrip("/") or "/")

    wandb = _mapping("wandb", raw.get("wandb"))
    _check_keys("wandb.", wandb, WANDB_KEYS)
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
        every = _positive_int("checkpoint_every_steps", every_raw, minimum=0)
    job_type = wandb.get("job_type") or "scaling"
    for key, val in (("group", group), ("job_type", job_type)):
        if not isinstance(val, str):
            raise SweepError(f"wandb.{key}: expected a string, got {val!r}")

    hardware = {
        "gpu": "H100-SXM",
        "peak_tflops": 989.0,
        "mfu": "predicted",
        "sequences_per_gpu": 16,
    }
    hw = _mapping("hardware", raw.get("hardware"))
    _check_keys("hardware.", hw, HARDWARE_KEYS)
    hardware.update(hw)
    peak = _positive_float("hardware.peak_tflops", hardware["peak_tflops"])
    seqs_per_gpu = _positive_int("hardware.sequences_per_gpu", hardware["sequences_per_gpu"])
    predicted_gpu = None
    predicted: dict[str, float] = {}  # model size -> predicted MFU
    if hardware["mfu"] == "predicted":
        predicted_gpu = _accounting_gpu(str(hardware["gpu"]))
        mfu = 0.0
    else:
        mfu = _positive_float("hardware.mfu", hardware["mfu"])
        if mfu > 1:
            raise SweepError(f"hardware.mfu: a fraction in (0, 1] or 'predicted', got {mfu}")

    defaults = _mapping("defaults", raw.get("defaults"))
    _check_keys("defaults.", defaults, RULE_KEYS)
    models = raw.get("models")
    if not isinstance(models, list) or not models:
        raise SweepError("models: required, a non-empty list of {config: <model config>, ...}")

    runs: list[RunSpec] = []
    owner: dict[str, str] = {}
    for i, entry in enumerate(models):
        where = f"models[{i}]"
        if isinstance(entry, str):
            entry = {"config": entry}
        entry = _mapping(where, entry)
        _check_keys(f"{where}.", entry, MODEL_KEYS)
        config = entry.get("config")
        if not isinstance(config, str) or not config:
            raise SweepError(f"{where}.config: required, a model config name from configs/model/")
        model_ref = _resolve_model_ref(config, path)
        size = entry.get("name") or Path(config).stem
        if not isinstance(size, str) or not RUN_NAME_RE.match(size):
            raise SweepError(f"{where}.name: letters/digits/._- only, got {size!r}")
        model_overrides = _mapping(f"{where}.model_overrides", entry.get("model_overrides"))
        for key, value in model_overrides.items():
            if not isinstance(value, (int, float, str, bool)) and value is not None:
                raise SweepError(
                    f"{where}.model_overrides.{key}: expected a number, string, bool or null, "
                    f"got {value!r}"
                )
        try:  # each model with its own family's config class (a mixed sweep mixes classes)
            facts = model_facts(model_ref, seq_len, model_overrides)
        except ConfigError as err:
            msg = str(err)
            field_ = re.split(r"[:\s]", msg.removeprefix("model."), maxsplit=1)[0]
            if field_ in model_overrides or "unknown key" in msg and model_overrides:
                key = f"{where}.model_overrides"  # the entry's own change is at fault
            else:
                key = f"{where}.config"
            detail = msg if config in msg else f"{config}: {msg}"
            raise SweepError(f"{key}: {detail} (runs {name}-{size}-s*)") from None
        family = entry.get("family") or facts.label
        if not isinstance(family, str):
            raise SweepError(f"{where}.family: expected a string, got {family!r}")
        rules = {k: v for k, v in defaults.items()}
        if "tokens" in entry or "tokens_per_param" in entry:  # a size's budget replaces the default
            rules.pop("tokens", None)
            rules.pop("tokens_per_param", None)
        rules.update({k: v for k, v in entry.items() if k in RULE_KEYS})
        for key in REQUIRED_RULES:
            if key not in rules:
                raise SweepError(f"{where}.{key}: required (set it in defaults or on the model)")
        has_tpp, has_tok = "tokens_per_param" in rules, "tokens" in rules
        if has_tpp == has_tok:
            raise SweepError(
                f"{where}: give exactly one of tokens_per_param or tokens "
                "(in defaults or on the model)"
            )
        budget_key = "tokens_per_param" if has_tpp else "tokens"
        budgets = rules[budget_key] if isinstance(rules[budget_key], list) else [rules[budget_key]]
        if not budgets:
            raise SweepError(f"{where}.{budget_key}: empty list")
        budgets = [_positive_float(f"{where}.{budget_key}", b) for b in budgets]
        gbs = _positive_int(f"{where}.global_batch_size", rules["global_batch_size"])
        lr = _positive_float(f"{where}.lr", rules["lr"])
        warmup = _positive_int(f"{where}.warmup_steps", rules["warmup_steps"], minimum=0)
        min_lr = rules.get("min_lr_ratio")
        if min_lr is not None:
            if (
                isinstance(min_lr, bool)
                or not isinstance(min_lr, (int, float))
                or not 0 <= min_lr <= 1
            ):
                raise SweepError(f"{where}.min_lr_ratio: a fraction in [0, 1], got {min_lr!r}")
            min_lr = float(min_lr)
        extra = rules.get("overrides") or []
        if not isinstance(extra, list) or not all(isinstance(o, str) and "=" in o for o in extra):
            raise SweepError(
                f"{where}.overrides: expected a list of 'key=value' strings, got {extra!r}"
            )
        reserved = {"model", "seed", "run_name"}
        for o in extra:
            if o.split("=", 1)[0].strip() in reserved:
                raise SweepError(f"{where}.overrides: '{o}' is set by the sweep itself; remove it")
        _check_tp_override(where, facts.config, extra)

        params, per_token = facts.params, facts.flops_per_token
        run_mfu = mfu
        if predicted_gpu is not None:
            if not family_of(facts.config).launch_accounting:
                raise SweepError(
                    f"hardware.mfu: 'predicted' is {titles_where(lambda s: s.launch_accounting)}"
                    f"'s launch accounting only, but {where} ({config}) is family "
                    f"{facts.registry_name}; give a measured fraction (hardware.mfu: 0.4)"
                )
            run_mfu = (
                _predicted_mfu(
                    facts.config, seqs_per_gpu, seq_len, predicted_gpu, _tp_override(extra)
                )
                if price
                else float("nan")
            )
            predicted[size] = run_mfu
        tokens_per_step = gbs * seq_len
        for budget in budgets:
            target = budget * params if has_tpp else budget
            steps = max(1, math.ceil(target / tokens_per_step))
            if warmup >= steps:
                raise SweepError(
                    f"{where} ({size}): warmup_steps {warmup} >= total steps "
                    f"{steps} ({_short(target)} tokens / {tokens_per_step} per "
                    "step); lower warmup_steps or raise the token budget"
                )
            tokens = steps * tokens_per_step
            label = size + (f"-{_token_label(rules, budget)}" if len(budgets) > 1 else "")
            for seed in seeds:
                run_name = f"{name}-{label}-s{seed}"
                if run_name in owner:
                    raise SweepError(
                        f"duplicate run name '{run_name}' ({owner[run_name]} and "
                        f"{where}); give one of them a distinct `name`"
                    )
                owner[run_name] = where
                flops = per_token * tokens
                runs.append(
                    RunSpec(
                        name=run_name,
                        sweep=name,
                        family=family,
                        registry_family=facts.registry_name,
                        size=size,
                        model=model_ref,
                        seed=seed,
                        params=params,
                        tokens=tokens,
                        tokens_per_param=tokens / params,
                        total_steps=steps,
                        global_batch_size=gbs,
                        seq_len=seq_len,
                        lr=lr,
                        warmup_steps=warmup,
                        min_lr_ratio=min_lr,
                        data_remote=data_remote,
                        checkpoint_root=_join(ckpt_root, run_name),
                        run_dir=_join(run_root, run_name) if run_root else None,
                        wandb_project=project,
                        wandb_group=group,
                        wandb_job_type=job_type,
                        flops=flops,
                        gpu_hours=flops / (peak * 1e12 * run_mfu) / 3600.0,
                        base_config=base_config,
                        extra_overrides=tuple(extra),
                        model_overrides=tuple(model_overrides.items()),
                        checkpoint_every_steps=(
                            every
                            if every is not None
                            else math.ceil(steps / DEFAULT_CHECKPOINTS_PER_RUN)
                        ),
                        wandb_mode=wandb_mode,
                    )
                )
    if predicted_gpu is not None:
        hardware["predicted_mfu"] = predicted
        hardware["priced_with"] = _pricing_basis(predicted_gpu)
    description = raw.get("description") or ""
    return Sweep(
        name=name,
        path=path,
        runs=runs,
        seeds=seeds,
        hardware=hardware,
        notes=notes,
        description=str(description),
    )


def _resolve_model_ref(config: str, sweep_path: Path) -> str:
    """A config name stays a name; a .yaml path is taken relative to the sweep file."""
    if Path(config).suffix in (".yaml", ".yml"):
        p = Path(config)
        if not p.is_absolute():
            p = (sweep_path.parent / p).resolve()
        return str(p)
    return config


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


# ----------------------------------------------------------------------------- plan


def _mfu_text(hw: Mapping[str, Any]) -> str:
    if hw["mfu"] != "predicted":
        return f"{float(hw['mfu']):.0%} MFU"
    per_size = ", ".join(f"{size} {m:.1%}" for size, m in hw.get("predicted_mfu", {}).items())
    basis = f"; {hw['priced_with']}" if hw.get("priced_with") else ""
    return (
        f"the MFU predicted by gpn_scale.accounting.gpu_model at {hw['sequences_per_gpu']} "
        f"sequences per GPU (a size with a parallel.tp override: accounting/tp_model.py's "
        f"speed-up; {per_size}; give a measured hardware.mfu to override){basis}"
    )


def format_plan(sweep: Sweep) -> str:
    """The human-readable plan: one row per run, then totals and assumptions."""
    hw = sweep.hardware
    rows = [
        (
            "run",
            "family",
            "params",
            "tokens",
            "tok/param",
            "steps",
            "batch",
            "lr",
            "warmup",
            "FLOPs",
            "GPU-h",
        )
    ]
    for r in sweep.runs:
        rows.append(
            (
                r.name,
                r.family,
                _short(r.params),
                _short(r.tokens),
                f"{r.tokens_per_param:.3g}",
                str(r.total_steps),
                str(r.global_batch_size),
                f"{r.lr:.3g}",
                str(r.warmup_steps),
                f"{r.flops:.3g}",
                f"{r.gpu_hours:.3g}",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = [
        f"sweep {sweep.name} ({sweep.path}): {len(sweep.runs)} runs = "
        f"{len({(r.size, r.tokens) for r in sweep.runs})} size/budget cells x "
        f"{len(sweep.seeds)} seeds {sweep.seeds}"
    ]
    if sweep.description:
        lines.append(sweep.description.strip())
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(
                cell.ljust(w) if c < 2 else cell.rjust(w)
                for c, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    r0 = sweep.runs[0]
    run_dirs = (
        r0.run_dir.rsplit("/", 1)[0] + "/<run>" if r0.run_dir else "runs/<run> (trainer default)"
    )
    lines += [
        f"total: {sweep.total_flops:.3g} FLOPs, {sweep.total_gpu_hours:,.4g} GPU-hours "
        f"(at {_mfu_text(hw)} of {float(hw['peak_tflops']):g} TFLOP/s per "
        f"{hw['gpu']}; FLOPs = 3 x forward per token)",
        f"data {r0.data_remote} (seq_len {r0.seq_len}); checkpoints "
        f"{r0.checkpoint_root.rsplit('/', 1)[0]}/<run>; run dirs "
        f"{run_dirs}"
        f"; W&B {r0.wandb_project}/{r0.wandb_group} ({r0.wandb_job_type})",
    ]
    lines += ["", *format_family_rows(sweep)]
    lines += [f"NOTE: {n}" for n in sweep.notes]
    return "\n".join(lines)


def format_family_rows(sweep: Sweep) -> list[str]:
    """One row per family label: its registry family, sizes, runs, parameter range, FLOPs and
    GPU-hours (what a families sweep spends on each curve)."""
    rows = [("family", "registry", "sizes", "runs", "params", "FLOPs", "GPU-h")]
    for fam in dict.fromkeys(r.family for r in sweep.runs):
        runs = [r for r in sweep.runs if r.family == fam]
        lo, hi = min(r.params for r in runs), max(r.params for r in runs)
        rows.append(
            (
                fam,
                ",".join(dict.fromkeys(r.registry_family for r in runs)),
                str(len({r.size for r in runs})),
                str(len(runs)),
                _short(lo) if lo == hi else f"{_short(lo)}-{_short(hi)}",
                f"{sum(r.flops for r in runs):.3g}",
                f"{sum(r.gpu_hours for r in runs):.4g}",
            )
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    out = []
    for i, row in enumerate(rows):
        out.append(
            "  ".join(
                cell.ljust(w) if c < 2 else cell.rjust(w)
                for c, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def validate_with_trainer(sweep: Sweep) -> None:
    """Load every run's training config (base config + overrides) through the trainer's own
    schema, so a bad key or value fails at plan time, naming the run; and `compile.enable`
    against the run's family (GPN refuses it: a mixed sweep sets it on the baselines'
    entries, `overrides: [compile.enable=true]`)."""
    from gpn_scale.run.config import load_train_config
    from gpn_scale.run.model import check_compile

    for run in sweep.runs:
        try:
            cfg = load_train_config(run.base_config, run.train_overrides())
            check_compile(cfg, get_family(run.registry_family))
        except ConfigError as err:
            raise SweepError(f"run '{run.name}': the trainer rejects its config: {err}") from None


def _check_tp_override(where: str, cfg: Any, overrides: list[str]) -> None:
    """`parallel.tp=N` among a size's overrides: its heads and FFN width must split N ways
    (the trainer would refuse the run at start; `sweep plan` says so first)."""
    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() != "parallel.tp":
            continue
        try:
            tp = int(value)
        except ValueError:
            raise SweepError(f"{where}.overrides: '{o}': tp must be an integer") from None
        if tp < 1:
            raise SweepError(f"{where}.overrides: '{o}': tp must be >= 1")
        spec = family_of(cfg)
        if tp > 1 and spec.apply_tp is None:
            raise SweepError(f"{where}.overrides: '{o}': family {spec.name} has no tp plan")
        try:
            spec.check_tp(cfg, tp)
        except ConfigError as err:
            raise SweepError(f"{where}.overrides: {err}") from None
