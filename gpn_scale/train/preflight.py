"""Checks a run makes before it writes anything, worded in the run's own config keys.

The model and data layers know nothing of the training schema, so their messages say
`d_state` or `seq_len`; here the same problems are named by the key the user set
(`model_overrides.d_state`, `data.seq_len`, `run_dir`, `train.global_batch_size`).
Nothing in this module creates a file or a directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpn_scale.model.config import ConfigError
from gpn_scale.train.config import TrainConfig


def model_config(cfg: TrainConfig) -> Any:
    """The run's GPNConfig: `cfg.model` + `model_overrides` (+ `train.tbptt` when set, which
    the schema already checked); an invalid value fails naming the key it came from."""
    from gpn_scale.model import load_model_config

    overrides = dict(cfg.model_overrides)
    if cfg.train.tbptt is not None:
        overrides["tbptt"] = cfg.train.tbptt
    try:
        return load_model_config(cfg.model, overrides=overrides or None)
    except ConfigError as err:
        msg = str(err)
        field, sep, rest = msg.partition(": ")
        field = field.removeprefix("model.")
        if sep and field in cfg.model_overrides:
            raise ConfigError(f"model_overrides.{field}: {rest}") from None
        if cfg.model_overrides:  # a field of the model file that the overrides made invalid
            raise ConfigError(f"model={cfg.model} with model_overrides "
                              f"{dict(cfg.model_overrides)}: {msg}") from None
        raise


def check_run_dir(run_dir: str) -> None:
    """One line naming `run_dir` when it cannot be created or written (nothing is created)."""
    path = Path(run_dir).absolute()
    probe = path
    while not probe.exists():  # the first ancestor that exists decides
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"run_dir {run_dir}: {probe} is a file, not a directory; choose "
                          "another run_dir")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"run_dir {run_dir}: {probe} is not writable; choose another run_dir")


def check_data(cfg: TrainConfig, remote: str, vocab_size: int, micro_batch: int,
               dp_size: int, evaluates: bool = True) -> Any:
    """The dataset's metadata, after checking that this run can use it: `data.seq_len`, the
    model's vocabulary, and enough windows for one training step and (when the run
    evaluates) one eval batch."""
    from gpn_scale.data import DataError
    from gpn_scale.data.metadata import read_metadata

    meta = read_metadata(remote)
    if cfg.data.seq_len != meta.seq_len:
        raise DataError(f"data.seq_len={cfg.data.seq_len} does not match the dataset {remote} "
                        f"(windows of {meta.seq_len} tokens); set data.seq_len={meta.seq_len} "
                        f"or rebuild the data with --seq-len {cfg.data.seq_len}")
    if vocab_size < meta.vocab_size:
        raise DataError(f"the model's vocab_size {vocab_size} (model={cfg.model}) is below "
                        f"the dataset's {meta.vocab_size} ({remote}); set "
                        f"model_overrides.vocab_size={meta.vocab_size} or use other data")
    for split, need, key in (
            ("train", cfg.train.global_batch_size, "train.global_batch_size"),
            ("val", (cfg.eval.batch_size or micro_batch) * dp_size,
             "eval.batch_size" if cfg.eval.batch_size else "train.global_batch_size "
             "(or set eval.batch_size)")):
        if split == "val" and not evaluates:
            continue
        info = meta.splits.get(split)
        have = info.samples if info is not None else 0
        if have < need:
            raise DataError(f"data.remote {remote}: the {split} split has {have} windows, "
                            f"fewer than one batch needs ({need}); lower {key} or build "
                            "more data")
    return meta
