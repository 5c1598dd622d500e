"""Threads, deterministic algorithms and seeds: what makes a CPU run resume bit-exactly."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from gpn_scale.run.config import TrainConfig


def resolve_deterministic(value: bool | str, device: torch.device) -> bool:
    """train.deterministic: "auto" = on CPU only (see TrainSection), true/false as given."""
    return device.type == "cpu" if value == "auto" else bool(value)


def set_determinism(cfg: TrainConfig, device: torch.device) -> bool:
    """Threads and deterministic algorithms; returns whether the latter are on."""
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    deterministic = resolve_deterministic(cfg.train.deterministic, device)
    if deterministic:
        # warn_only: a few CUDA kernels have no deterministic variant; on CPU all of ours do.
        torch.use_deterministic_algorithms(True, warn_only=True)
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False
    return deterministic


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
