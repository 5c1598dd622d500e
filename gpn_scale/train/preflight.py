"""Checks a run makes before it writes anything, worded in the run's own config keys.

The model and data layers know nothing of the training schema, so their messages say
`d_state` or `seq_len`; here the same problems are named by the key the user set
(`model_overrides.d_state`, `data.seq_len`, `run_dir`, `train.global_batch_size`).
Nothing in this module creates a file or a directory.
"""

from __future__ import annotations

from typing import Any

from gpn_scale.core.config import ConfigError
from gpn_scale.io.run_folder import DONE, default_corpus_dir
from gpn_scale.run.config import TrainConfig
from gpn_scale.run.model import model_config


def check_tensor_parallel(model_cfg: Any, tp: int) -> None:
    """One line when the model cannot train at `parallel.tp = tp`: its family has no trainer
    tp plan, or its heads / widths / vocabulary do not split over tp (the family's own
    check names the field)."""
    if tp == 1:
        return
    from gpn_scale.models.registry import families_where, family_of

    spec = family_of(model_cfg)
    if spec.apply_tp is None:
        takers = ", ".join(s.name for s in families_where(lambda s: s.apply_tp is not None))
        raise ConfigError(
            f"parallel.tp={tp}: the trainer has no tensor-parallel plan for model family "
            f"{spec.name} (only {takers}); use parallel.tp=1"
        )
    spec.check_tp(model_cfg, tp)


def check_model_device(cfg: TrainConfig, model_cfg: Any, device_type: str) -> None:
    """One line when the model's kernels cannot run on this device (a Gated DeltaNet backend
    forced to fla's CUDA kernels on a CPU, a bogus GPN_SCALE_GDN_BACKEND): before the run
    folder exists, not at step 1; a model field is named as the override the user set."""
    from gpn_scale.models.registry import family_of

    try:
        family_of(model_cfg).check_device(model_cfg, device_type)
    except ConfigError as err:
        msg = str(err)
        field = msg.split("=", 1)[0].split(":", 1)[0]
        if field in cfg.model_overrides:
            raise ConfigError(f"model_overrides.{msg}") from None
        raise


def check_launch(cfg: TrainConfig, nodes: int, procs_per_node: int) -> list[str]:
    """What `slurm/train.sbatch` checks before it starts any trainer (no I/O): the world of
    `nodes` x `procs_per_node` processes splits into tp groups, the model splits over tp,
    and each data-parallel rank's micro batches (train and eval) split into tp pieces; the
    same checks the trainers make at start, so a bad launch fails in one line before the
    job's nodes start torchrun. Returns warnings (a tp group that spans nodes runs every
    step's all-reduces over the network)."""
    from gpn_scale.core.env import check_world
    from gpn_scale.run.config import batch_layout

    if nodes < 1 or procs_per_node < 1:
        raise ConfigError(
            f"--check-launch: nodes and processes per node must be >= 1, got {nodes} "
            f"{procs_per_node}"
        )
    tp, world = cfg.parallel.tp, nodes * procs_per_node
    check_world(world, tp)
    check_tensor_parallel(model_config(cfg), tp)
    micro, _ = batch_layout(cfg, world // tp)
    for split, batch in (("train", micro), ("val", cfg.eval.batch_size or micro)):
        if batch % tp:
            raise ConfigError(
                f"parallel.tp: {tp} does not divide the {split} micro batch {batch} per data-"
                "parallel rank (a tp group reads it in tp pieces); change the batch or tp"
            )
    warnings = []
    if tp > 1 and nodes > 1 and procs_per_node % tp and tp % procs_per_node:
        warnings.append(
            f"parallel.tp={tp} with {procs_per_node} processes per node: some tp groups span "
            "two nodes, so their per-step all-reduces cross the network; use a tp that "
            f"divides {procs_per_node}"
        )
    elif tp > procs_per_node:
        warnings.append(
            f"parallel.tp={tp} exceeds the {procs_per_node} processes per node: every tp "
            "group spans nodes and its per-step all-reduces cross the network; use "
            f"tp <= {procs_per_node}"
        )
    return warnings


def check_run_dir(run_dir: str) -> None:
    """One line naming `run_dir` when it cannot be created or written (nothing is left: the
    probe directory a write test makes is removed at once)."""
    check_local_dir(run_dir, "run_dir", probe=True)


def check_local_dir(path_str: str, key: str, probe: bool = False) -> bool:
    """One line naming `key` when the directory cannot be created or written; returns
    whether it exists already. Nothing is created (the first existing ancestor decides;
    `probe`: a write test there too, gpn_scale/io/outputs.py)."""
    from gpn_scale.io.outputs import check_out_dir

    return check_out_dir(path_str, key, error=ConfigError, probe=probe)


def check_data(
    cfg: TrainConfig,
    remote: str,
    vocab_size: int,
    micro_batch: int,
    dp_size: int,
    evaluates: bool = True,
) -> Any:
    """The dataset's metadata, after checking that this run can use it: `data.seq_len`, the
    model's vocabulary, and enough windows for one training step and (when the run
    evaluates) one eval batch."""
    from gpn_scale.data import DataError
    from gpn_scale.data.metadata import read_metadata

    meta = read_metadata(remote)
    if cfg.data.seq_len != meta.seq_len:
        raise DataError(
            f"data.seq_len={cfg.data.seq_len} does not match the dataset {remote} "
            f"(windows of {meta.seq_len} tokens); set data.seq_len={meta.seq_len} "
            f"or rebuild the data with --seq-len {cfg.data.seq_len}"
        )
    if vocab_size < meta.vocab_size:
        raise DataError(
            f"the model's vocab_size {vocab_size} (model={cfg.model}) is below "
            f"the dataset's {meta.vocab_size} ({remote}); set "
            f"model_overrides.vocab_size={meta.vocab_size} or use other data"
        )
    for split, need, key in (
        ("train", cfg.train.global_batch_size, "train.global_batch_size"),
        (
            "val",
            (cfg.eval.batch_size or micro_batch) * dp_size,
            "eval.batch_size"
            if cfg.eval.batch_size
            else "train.global_batch_size (or set eval.batch_size)",
        ),
    ):
        if split == "val" and not evaluates:
            continue
        info = meta.splits.get(split)
        have = info.samples if info is not None else 0
        if have < need:
            raise DataError(
                f"data.remote {remote}: the {split} split has {have} windows, "
                f"fewer than one batch needs ({need}); lower {key} or build "
                "more data"
            )
    return meta


def dry_run(cfg: TrainConfig, resume: str) -> str:
    """`gpn-scale train --dry-run`: everything a start would check, read-only, as a report
    (the resolved config, then what the run would use). Trains nothing, writes nothing:
    local locations are checked for writability without being created, an S3 checkpoint
    root is listed (credentials, bucket) but not written to."""
    import copy
    import json

    import torch

    from gpn_scale.core.env import detect
    from gpn_scale.models.registry import family_of
    from gpn_scale.run.config import batch_layout, to_yaml

    model_cfg = model_config(cfg)
    world = detect().world_size
    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()  # as rank_device decides
    check_model_device(cfg, model_cfg, "cuda" if cuda else "cpu")
    micro, accum = batch_layout(cfg, world)
    run_dir, ckpt_root = cfg.resolved_run_dir, cfg.resolved_checkpoint_root
    run_dir_exists = check_local_dir(run_dir, "run_dir")
    mgr, where = _dry_run_checkpoints(cfg, ckpt_root)
    resume_uri = mgr.resolve_resume(resume) if resume != "none" else None
    if resume == "auto" and resume_uri is None:
        mgr.refuse_start_over()  # as a start would: damaged checkpoints are not started over
    finished = None
    if resume != "none":
        raw = mgr.storage.get_bytes(DONE_MARKER)
        try:
            done = json.loads(raw) if raw else None
        except ValueError:
            done = None
        finished = finished_at(done, resume_uri, cfg.schedule.total_steps)
    if resume_uri and finished is None:  # the shape check a start makes before loading
        check_model_compatible(mgr.read_meta(resume_uri).get("model_config"), model_cfg, resume_uri)
    data = _dry_run_data(cfg, run_dir, model_cfg, micro, world)

    resolved = copy.deepcopy(cfg)
    resolved.run_dir, resolved.checkpoint.root = run_dir, ckpt_root
    tokens = cfg.schedule.total_steps * cfg.train.global_batch_size * cfg.data.seq_len
    lines = [
        f"model: {model_cfg.name or cfg.model} ({model_cfg.family}), "
        f"{family_of(model_cfg).count_parameters(model_cfg):,} parameters",
        f"data: {data}",
        f"batch: {cfg.train.global_batch_size} sequences = micro {micro} x accum {accum} x "
        f"world {world}; {cfg.schedule.total_steps} steps, {tokens:,} tokens",
        f"run_dir: {run_dir}{'' if run_dir_exists else ' (would be created)'}",
        f"checkpoints: {where}",
        "resume: "
        + (
            f"{resume}: the run already finished at step {finished} "
            f"({mgr.storage.child_uri(DONE_MARKER)}); a start would do nothing: raise "
            "schedule.total_steps to train further, or --fresh to start over"
            if finished is not None
            else f"{resume} -> {resume_uri}"
            if resume_uri
            else f"{resume}: no complete checkpoint, would start fresh"
            if resume == "auto"
            else "none: would start fresh"
        ),
        f"W&B: {cfg.logging.wandb.mode}"
        + (" (not contacted by --dry-run)" if cfg.logging.wandb.mode == "online" else ""),
        "dry run: config, model, data and checkpoint locations are valid; nothing was "
        "trained or written",
    ]
    return to_yaml(resolved).rstrip() + "\n---\n" + "\n".join(lines)


def _dry_run_checkpoints(cfg: TrainConfig, ckpt_root: str) -> tuple[Any, str]:
    """(the checkpoint manager, where the checkpoints go): read-only."""
    from gpn_scale.checkpoint import CheckpointManager

    if "://" in ckpt_root:
        mgr = CheckpointManager(ckpt_root, keep_last=cfg.checkpoint.keep_last)
        found = len(mgr.storage.list_dirs())  # credentials and bucket, read-only
        return mgr, f"{ckpt_root} (listed: {found} entries; write access not probed)"
    exists = check_local_dir(ckpt_root, "checkpoint.root")
    mgr = CheckpointManager(ckpt_root, keep_last=cfg.checkpoint.keep_last)
    return mgr, f"{ckpt_root}{'' if exists else ' (would be created)'}"


def _dry_run_data(cfg: TrainConfig, run_dir: str, model_cfg: Any, micro: int, world: int) -> str:
    """What the run would read (the default corpus is checked once it is built)."""
    from gpn_scale.data import METADATA_FILE
    from gpn_scale.run.config import DEFAULT_CORPUS

    if cfg.data.remote == DEFAULT_CORPUS:
        built = default_corpus_dir(run_dir, cfg.data.seq_len)
        if (built / METADATA_FILE).is_file():
            meta = check_data(cfg, str(built), model_cfg.vocab_size, micro, world)
            return _data_line(str(built), meta)
        return f"the embedded default corpus, built on first use under {built}"
    meta = check_data(cfg, cfg.data.remote, model_cfg.vocab_size, micro, world)
    return _data_line(cfg.data.remote, meta)


def _data_line(remote: str, meta: Any) -> str:
    return (
        f"{remote} (seq_len {meta.seq_len}, vocab {meta.vocab_size}, "
        + ", ".join(
            f"{name} {info.samples:,} windows" for name, info in sorted(meta.splits.items())
        )
        + ")"
    )


# The marker a finished run writes under its checkpoint root (its step and the run's end).
DONE_MARKER = DONE


def finished_at(done: dict | None, resume_uri: str | None, total_steps: int) -> int | None:
    """The step a run finished at when its DONE marker says it reached `total_steps` and no
    newer checkpoint exists (a start then has nothing to do), else None."""
    if done is None:
        return None
    done_step = int(done.get("step", 0) or 0)
    ckpt_step = last_ckpt_step(resume_uri)
    if done_step >= total_steps and (ckpt_step is None or ckpt_step <= done_step):
        return done_step
    return None


def last_ckpt_step(uri: str | None) -> int | None:
    """The step encoded in a checkpoint URI (…/step_000123 or …/step-123), else None."""
    if not uri:
        return None
    import re

    m = re.search(r"step[_-]?0*(\d+)/?$", uri)
    return int(m.group(1)) if m else None


def check_model_compatible(saved: dict | None, current, uri: str, use: str = "resume") -> None:
    """One line when a checkpoint was written for another family or model shape (the keys
    come from the family's spec: `compat_keys`; a saved config without `family` is GPN's).
    `use`: "resume", or the key that named the checkpoint (checkpoint.initial_load)."""
    if not saved:
        return
    from gpn_scale.models.registry import DEFAULT_FAMILY, family_of, shape_differences

    spec = family_of(current)
    saved_family = saved.get("family", DEFAULT_FAMILY)
    what = "checkpoint" if use == "resume" else use
    fix = "or a fresh checkpoint.root" if use == "resume" else f"or another {use}"
    if saved_family != spec.name:
        raise ConfigError(
            f"{what} {uri} is a {saved_family} model, not {spec.name} "
            f"(model={getattr(current, 'name', '') or spec.name}); use a {saved_family} model "
            f"config to {'resume it' if use == 'resume' else 'start from it'}, {fix}"
        )
    diff = shape_differences(spec, saved, current)
    if diff:
        raise ConfigError(
            f"{what} {uri} is for another model shape ({', '.join(diff)}); "
            f"use the model config it was trained with, {fix}"
        )
