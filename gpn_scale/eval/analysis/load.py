"""The one place the analyses get a model from a checkpoint (swap in the shared loader here).

CHECKPOINT is a step directory (.../step_NNNNNNNNN), a checkpoint root holding them, or a run
directory with a `checkpoints/` root; the newest complete checkpoint is taken from a root.
The model's config comes from the checkpoint's manifest, the weights through the same
CheckpointManager / DCP load the trainer and `gpn-scale eval` use (model state only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpn_scale.core.config import ConfigError

_STEP = re.compile(r"^step_\d{9,}$")


@dataclass
class LoadedModel:
    model: nn.Module
    config: Any  # the family's config (GPNConfig for GPN)
    meta: dict[str, Any]  # the checkpoint's meta (step, tokens, config, model_config, ...)
    uri: str


def _resolve(checkpoint: str):
    from gpn_scale.checkpoint import CheckpointManager

    text = checkpoint.rstrip("/")
    if _STEP.match(text.rsplit("/", 1)[-1]):
        parent = text.rsplit("/", 1)[0] if "/" in text else "."
        return CheckpointManager(parent), text
    roots = [text]
    if "://" not in text and (Path(text) / "checkpoints").is_dir():
        roots.insert(0, str(Path(text) / "checkpoints"))
    if "://" not in text and not Path(text).exists():
        raise ConfigError(
            f"checkpoint {checkpoint}: no such file or directory; pass a step directory, "
            "a checkpoint root or a run directory"
        )
    for root in roots:
        mgr = CheckpointManager(root)
        uri = mgr.latest()
        if uri is not None:
            return mgr, uri
    raise ConfigError(
        f"checkpoint {checkpoint}: no complete checkpoint (step_NNNNNNNNN with a manifest) "
        "under it; pass a step directory, a checkpoint root or a run directory"
    )


def load_model(checkpoint: str, device: torch.device | str = "cpu") -> LoadedModel:
    """Build the checkpoint's model and load its weights (eval mode, on `device`)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    from gpn_scale.models.registry import config_from_dict

    mgr, uri = _resolve(checkpoint)
    meta = mgr.read_meta(uri)
    model_cfg = meta.get("model_config")
    if not isinstance(model_cfg, dict):
        raise ConfigError(f"{uri}: the checkpoint's manifest has no model_config; re-save it")
    spec, cfg = config_from_dict(model_cfg)
    uri = mgr.resolve_resume(uri) or uri  # completeness check of an explicit step dir
    model = spec.build(cfg)
    app: dict[str, Any] = {"model": get_model_state_dict(model)}
    mgr.load(uri, app)
    set_model_state_dict(model, app["model"])
    return LoadedModel(model.to(device).eval(), cfg, meta, uri)


def checkpoint_family(checkpoint: str) -> tuple[str, str]:
    """(family name, resolved URI) from the manifest alone, before any weights are read."""
    mgr, uri = _resolve(checkpoint)
    model_cfg = mgr.read_meta(uri).get("model_config") or {}
    return str(model_cfg.get("family", "gpn")), uri
