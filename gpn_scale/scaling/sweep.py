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

Here: loading, and each `models` entry expanded into its runs. Beside it: sweep_schema.py
(the keys, the value checks, the sweep-wide sections), sweep_spec.py (RunSpec, Sweep,
SweepError: what the launchers and fits read), sweep_price.py (GPU-hours under `mfu:
predicted`, the `parallel.tp` check) and sweep_plan.py (`sweep plan`'s tables, the trainer's
check of every run). The public names callers use are importable from here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpn_scale.core.config import ConfigError, read_yaml, resolve_named_yaml
from gpn_scale.scaling.families import ModelFacts, model_facts
from gpn_scale.scaling.sweep_plan import (
    format_family_rows,
    format_plan,
    short,
    validate_with_trainer,
)
from gpn_scale.scaling.sweep_price import check_tp_override, pricing_basis, size_mfu
from gpn_scale.scaling.sweep_schema import (
    DEFAULT_CHECKPOINTS_PER_RUN,
    MODEL_KEYS,
    REPO_ROOT,
    REQUIRED_RULES,
    RULE_KEYS,
    RUN_NAME_RE,
    Sections,
    as_mapping,
    check_keys,
    positive_float,
    positive_int,
    read_sections,
)
from gpn_scale.scaling.sweep_spec import RunSpec, Sweep, SweepError

__all__ = [
    "RunSpec",
    "Sweep",
    "SweepError",
    "expand_sweep",
    "format_family_rows",
    "format_plan",
    "load_sweep",
    "resolve_sweep_path",
    "validate_with_trainer",
]

SWEEP_DIR = REPO_ROOT / "configs" / "sweeps"


def resolve_sweep_path(name_or_path: str | Path) -> Path:
    return resolve_named_yaml(name_or_path, SWEEP_DIR, "sweep", SweepError)


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def _token_label(has_tpp: bool, value: float) -> str:
    if has_tpp:
        return f"tpp{value:g}"
    return f"d{short(value)}"


# ----------------------------------------------------------------------------- loading


def load_sweep(
    name_or_path: str | Path, *, allow_few_seeds: bool = False, price: bool = True
) -> Sweep:
    """Read, validate and expand a sweep file (by path or by name in configs/sweeps/).
    `price`: compute the GPU-hours (with `mfu: predicted`, 1-2 s per model size of launch
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


def expand_sweep(name_or_path: str | Path, *, allow_few_seeds: bool = False) -> list[RunSpec]:
    """The runs of a sweep file, validated (see module docstring)."""
    return load_sweep(name_or_path, allow_few_seeds=allow_few_seeds).runs


# ----------------------------------------------------------------------------- expansion
# The sweep-wide sections first (sweep_schema.read_sections), then each `models` entry: its
# model, its rules, its price, its runs. Each stage checks in the file's order, so the first
# fault is the one named.


@dataclass(frozen=True)
class _Size:
    """One `models` entry, validated: a model size and its config's facts."""

    where: str  # models[i]
    entry: dict[str, Any]
    config: str
    model_ref: str
    size: str
    model_overrides: dict[str, Any]
    facts: ModelFacts
    family: str


@dataclass(frozen=True)
class _Rules:
    """A size's training rules (the defaults, then the entry's own), validated."""

    has_tpp: bool  # token budgets per parameter (else in tokens)
    budgets: list[float]
    gbs: int
    lr: float
    warmup: int
    min_lr: float | None
    extra: list[str]


def _expand(raw: dict[str, Any], path: Path, *, allow_few_seeds: bool, price: bool = True) -> Sweep:
    sections = read_sections(raw, path, allow_few_seeds)
    defaults = as_mapping("defaults", raw.get("defaults"))
    check_keys("defaults.", defaults, RULE_KEYS)
    models = raw.get("models")
    if not isinstance(models, list) or not models:
        raise SweepError("models: required, a non-empty list of {config: <model config>, ...}")

    runs: list[RunSpec] = []
    owner: dict[str, str] = {}  # run name -> the entry that made it
    predicted: dict[str, float] = {}  # model size -> predicted MFU
    for i, entry in enumerate(models):
        size = _read_size(f"models[{i}]", entry, sections)
        rules = _read_rules(size.where, defaults, size.entry)
        check_tp_override(size.where, size.facts.config, rules.extra)
        run_mfu = sections.mfu
        if sections.predicted_gpu is not None:
            run_mfu = size_mfu(
                size.where,
                size.config,
                size.facts,
                rules.extra,
                sections.seqs_per_gpu,
                sections.seq_len,
                sections.predicted_gpu,
                price,
            )
            predicted[size.size] = run_mfu
        runs += _size_runs(sections, size, rules, run_mfu, owner)
    if sections.predicted_gpu is not None:
        sections.hardware["predicted_mfu"] = predicted
        sections.hardware["priced_with"] = pricing_basis(sections.predicted_gpu)
    description = raw.get("description") or ""
    return Sweep(
        name=sections.name,
        path=path,
        runs=runs,
        seeds=sections.seeds,
        hardware=sections.hardware,
        notes=sections.notes,
        description=str(description),
    )


def _read_size(where: str, entry: Any, sections: Sections) -> _Size:
    """One `models` entry (a config name, or a mapping): its model, size label, model
    overrides and family label."""
    if isinstance(entry, str):
        entry = {"config": entry}
    entry = as_mapping(where, entry)
    check_keys(f"{where}.", entry, MODEL_KEYS)
    config = entry.get("config")
    if not isinstance(config, str) or not config:
        raise SweepError(f"{where}.config: required, a model config name from configs/model/")
    model_ref = _resolve_model_ref(config, sections.path)
    size = entry.get("name") or Path(config).stem
    if not isinstance(size, str) or not RUN_NAME_RE.match(size):
        raise SweepError(f"{where}.name: letters/digits/._- only, got {size!r}")
    model_overrides = as_mapping(f"{where}.model_overrides", entry.get("model_overrides"))
    for key, value in model_overrides.items():
        if not isinstance(value, (int, float, str, bool)) and value is not None:
            raise SweepError(
                f"{where}.model_overrides.{key}: expected a number, string, bool or null, "
                f"got {value!r}"
            )
    facts = _model_facts(where, config, model_ref, model_overrides, sections, size)
    family = entry.get("family") or facts.label
    if not isinstance(family, str):
        raise SweepError(f"{where}.family: expected a string, got {family!r}")
    return _Size(where, entry, config, model_ref, size, model_overrides, facts, family)


def _model_facts(
    where: str,
    config: str,
    model_ref: str,
    model_overrides: dict[str, Any],
    sections: Sections,
    size: str,
) -> ModelFacts:
    """The model counted with its own family's config class (a mixed sweep mixes classes); a
    config error names the key at fault: the entry's model_overrides or its config."""
    try:
        return model_facts(model_ref, sections.seq_len, model_overrides)
    except ConfigError as err:
        msg = str(err)
        field_ = re.split(r"[:\s]", msg.removeprefix("model."), maxsplit=1)[0]
        if field_ in model_overrides or "unknown key" in msg and model_overrides:
            key = f"{where}.model_overrides"  # the entry's own change is at fault
        else:
            key = f"{where}.config"
        detail = msg if config in msg else f"{config}: {msg}"
        raise SweepError(f"{key}: {detail} (runs {sections.name}-{size}-s*)") from None


def _read_rules(where: str, defaults: dict[str, Any], entry: dict[str, Any]) -> _Rules:
    """The size's rules: the defaults, then its own (its token budget replaces theirs)."""
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
            f"{where}: give exactly one of tokens_per_param or tokens (in defaults or on the model)"
        )
    budget_key = "tokens_per_param" if has_tpp else "tokens"
    budgets = rules[budget_key] if isinstance(rules[budget_key], list) else [rules[budget_key]]
    if not budgets:
        raise SweepError(f"{where}.{budget_key}: empty list")
    budgets = [positive_float(f"{where}.{budget_key}", b) for b in budgets]
    gbs = positive_int(f"{where}.global_batch_size", rules["global_batch_size"])
    lr = positive_float(f"{where}.lr", rules["lr"])
    warmup = positive_int(f"{where}.warmup_steps", rules["warmup_steps"], minimum=0)
    min_lr = rules.get("min_lr_ratio")
    if min_lr is not None:
        if isinstance(min_lr, bool) or not isinstance(min_lr, (int, float)) or not 0 <= min_lr <= 1:
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
    return _Rules(has_tpp, budgets, gbs, lr, warmup, min_lr, extra)


def _size_runs(
    sections: Sections, size: _Size, rules: _Rules, run_mfu: float, owner: dict[str, str]
) -> list[RunSpec]:
    """The size's runs, one per token budget and seed: <sweep>-<size>[-<budget>]-s<seed>
    (the budget named when the size has several); `owner` records each name's entry."""
    runs = []
    tokens_per_step = rules.gbs * sections.seq_len
    for budget in rules.budgets:
        target = budget * size.facts.params if rules.has_tpp else budget
        steps = max(1, math.ceil(target / tokens_per_step))
        if rules.warmup >= steps:
            raise SweepError(
                f"{size.where} ({size.size}): warmup_steps {rules.warmup} >= total steps "
                f"{steps} ({short(target)} tokens / {tokens_per_step} per "
                "step); lower warmup_steps or raise the token budget"
            )
        tokens = steps * tokens_per_step
        label = size.size + (
            f"-{_token_label(rules.has_tpp, budget)}" if len(rules.budgets) > 1 else ""
        )
        for seed in sections.seeds:
            run_name = f"{sections.name}-{label}-s{seed}"
            if run_name in owner:
                raise SweepError(
                    f"duplicate run name '{run_name}' ({owner[run_name]} and "
                    f"{size.where}); give one of them a distinct `name`"
                )
            owner[run_name] = size.where
            runs.append(_run_spec(sections, size, rules, run_name, seed, steps, tokens, run_mfu))
    return runs


def _run_spec(
    sections: Sections,
    size: _Size,
    rules: _Rules,
    run_name: str,
    seed: int,
    steps: int,
    tokens: int,
    run_mfu: float,
) -> RunSpec:
    flops = size.facts.flops_per_token * tokens
    return RunSpec(
        name=run_name,
        sweep=sections.name,
        family=size.family,
        registry_family=size.facts.registry_name,
        size=size.size,
        model=size.model_ref,
        seed=seed,
        params=size.facts.params,
        tokens=tokens,
        tokens_per_param=tokens / size.facts.params,
        total_steps=steps,
        global_batch_size=rules.gbs,
        seq_len=sections.seq_len,
        lr=rules.lr,
        warmup_steps=rules.warmup,
        min_lr_ratio=rules.min_lr,
        data_remote=sections.data_remote,
        checkpoint_root=_join(sections.ckpt_root, run_name),
        run_dir=_join(sections.run_root, run_name) if sections.run_root else None,
        wandb_project=sections.project,
        wandb_group=sections.group,
        wandb_job_type=sections.job_type,
        flops=flops,
        gpu_hours=flops / (sections.peak * 1e12 * run_mfu) / 3600.0,
        base_config=sections.base_config,
        extra_overrides=tuple(rules.extra),
        model_overrides=tuple(size.model_overrides.items()),
        checkpoint_every_steps=(
            sections.every
            if sections.every is not None
            else math.ceil(steps / DEFAULT_CHECKPOINTS_PER_RUN)
        ),
        wandb_mode=sections.wandb_mode,
    )


def _resolve_model_ref(config: str, sweep_path: Path) -> str:
    """A config name stays a name; a .yaml path is taken relative to the sweep file."""
    if Path(config).suffix in (".yaml", ".yml"):
        p = Path(config)
        if not p.is_absolute():
            p = (sweep_path.parent / p).resolve()
        return str(p)
    return config
