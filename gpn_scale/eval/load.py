"""One loader for every consumer of a trained model (eval tasks, generation, analyses,
export): a checkpoint reference -> (family spec, config, model in eval mode, tokenizer).

What a reference may be, how it resolves, its weights and the tokenizer it was trained with:
run/sources.py (shared with the trainer's warm start). Here: the model built for inference.
The model config is the one the checkpoint was saved with (the manifest's `model_config`,
family from the registry), so no training YAML is needed; `model_config=` must name the same
family and shape. `tokenizer=` may replace the recorded tokenizer file (e.g. when it moved)
but must be the same tokenizer (sha256) where the checkpoint records one.
Nothing here is collective: one process loads the full weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpn_scale.core.config import ConfigError
from gpn_scale.core.hardware import pick_device
from gpn_scale.data.tokenizer import Tokenizer
from gpn_scale.io.run_folder import FINAL_WEIGHTS, RUN_CONFIG
from gpn_scale.models.protocol import FamilySpec
from gpn_scale.run.sources import (
    Source,
    is_explicit,
    read_source,
    read_weights,
    resolve,
    root_of,
    tokenizer_of,
    training_data,
)


@dataclass
class LoadedModel:
    spec: FamilySpec
    config: Any
    model: nn.Module  # on `device`, in eval mode, no gradients
    loaded_tokenizer: Tokenizer | None  # None when loaded with_tokenizer=False
    checkpoint: str  # the resolved step directory URI or model_final.pt path
    step: int | None  # training step of the weights (None when unknown)
    device: torch.device
    meta: dict[str, Any] = field(default_factory=dict)  # the checkpoint's saved meta
    run_dir: str | None = None  # the run folder it belongs to, where it lies now

    @property
    def training_data(self) -> str | None:
        """The dataset the run trained on, resolved for where its run folder lies now."""
        return training_data(self.meta.get("config"), self.run_dir)

    @property
    def tokenizer(self) -> Tokenizer:
        if self.loaded_tokenizer is None:
            raise ConfigError(f"checkpoint {self.checkpoint}: loaded without its tokenizer")
        return self.loaded_tokenizer

    @property
    def name(self) -> str:
        return str(getattr(self.config, "name", "") or self.spec.name)


def _check_family(source: Source, spec: FamilySpec, cfg: Any, flag: str) -> None:
    """`--model-config` must describe the model the checkpoint holds: one line otherwise
    (not a DCP traceback about missing keys)."""
    from gpn_scale.models.registry import DEFAULT_FAMILY, shape_differences

    saved = source.meta.get("model_config")
    if not isinstance(saved, dict):
        return
    family = saved.get("family", DEFAULT_FAMILY)
    if family != spec.name:
        raise ConfigError(
            f"{flag}: checkpoint {source.uri} holds a {family} model, not {spec.name}; drop "
            f"{flag} (the checkpoint's own config is used) or pass a {family} config"
        )
    diff = shape_differences(spec, saved, cfg)
    if diff:
        raise ConfigError(
            f"{flag}: checkpoint {source.uri} has another shape ({', '.join(diff)}); drop "
            f"{flag} (the checkpoint's own config is used) or pass the config it was trained with"
        )


def load(
    ref: str,
    *,
    device: str | torch.device = "auto",
    tokenizer: str | None = None,
    model_config: str | None = None,
    dtype: torch.dtype | None = None,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Load a checkpoint for inference (see the module docstring for what `ref` may be).

    `tokenizer`: "byte" or a tokenizer.json path instead of the recorded file (the same
    tokenizer); `model_config`: a model config name / YAML instead of the saved one (a
    model_final.pt without its run's config.yaml needs it; otherwise it must match).
    `with_tokenizer=False`: for a caller that reads its own data's tokenizer (the analyses),
    so the training data need not be reachable. A one-line ConfigError for anything that
    does not fit. When `ref` names a folder (its newest checkpoint) and a live run's
    retention deletes that checkpoint while it loads, the newest one then is loaded.
    """
    from gpn_scale.checkpoint import CheckpointError, CheckpointManager

    dev = device if isinstance(device, torch.device) else pick_device(device)
    explicit = is_explicit(ref)
    for attempt in range(4):
        kind, uri = resolve(ref)
        try:
            return _load(kind, uri, dev, tokenizer, model_config, dtype, with_tokenizer)
        except CheckpointError:
            if explicit or kind != "dcp" or attempt == 3:
                raise
            if CheckpointManager(root_of(uri)).is_complete(uri):
                raise
            import sys

            print(
                f"gpn-scale: {uri} was deleted while loading (the run's retention); loading "
                "the newest checkpoint instead",
                file=sys.stderr,
                flush=True,
            )
    raise AssertionError("unreachable")


def _load(
    kind: str,
    uri: str,
    dev: torch.device,
    tokenizer: str | None,
    model_config: str | None,
    dtype: torch.dtype | None,
    with_tokenizer: bool,
) -> LoadedModel:
    from gpn_scale.models.registry import config_from_dict, load_model_config

    source = read_source(kind, uri)
    meta = source.meta
    step = int(meta["step"]) if meta.get("step") is not None else None
    if kind == "final" and model_config is None and "model_config" not in meta:
        raise ConfigError(
            f"checkpoint {uri}: no {RUN_CONFIG} beside it to name the model; pass "
            "--model-config NAME (and --tokenizer)"
        )
    if model_config is not None:
        spec, cfg = load_model_config(model_config)
        _check_family(source, spec, cfg, "--model-config")
    else:
        saved = meta.get("model_config")
        if not isinstance(saved, dict):
            raise ConfigError(
                f"checkpoint {uri}: its manifest has no model_config; pass --model-config NAME"
            )
        values = dict(saved)
        if meta.get("model_family"):
            values.setdefault("family", meta["model_family"])
        spec, cfg = config_from_dict(values)
    cfg = spec.for_inference(cfg)  # the exact model (bf16 memory reads are for training)

    tok = tokenizer_of(source, tokenizer) if with_tokenizer else None
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    if tok is not None and vocab and tok.vocab_size > vocab:
        raise ConfigError(
            f"tokenizer {tok.name} has {tok.vocab_size} ids but the model's vocab_size is "
            f"{vocab}; pass the tokenizer the model was trained with (--tokenizer)"
        )

    model = spec.build(cfg)
    try:
        state = read_weights(source, model, spec, cfg)
    except ConfigError as err:
        if "it is a deepspeed checkpoint" not in str(err):
            raise
        raise ConfigError(
            f"checkpoint {uri} is a DeepSpeed checkpoint, which only a DeepSpeed engine "
            f"reads; evaluate the run's {FINAL_WEIGHTS} (checkpoint.export_final=true)"
        ) from None
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        first = str(err).strip().splitlines()
        raise ConfigError(
            f"checkpoint {uri}: the weights do not fit the {spec.name} model "
            f"({' '.join(first[:2])[:200]}); pass the --model-config it was trained with"
        ) from None
    if dtype is not None:
        model = model.to(dtype)
    model = model.to(dev).eval()
    model.requires_grad_(False)
    return LoadedModel(spec, cfg, model, tok, uri, step, dev, meta, source.run_dir)


def describe_loaded(loaded: LoadedModel) -> str:
    """The line the commands print on stderr: which weights they use."""
    step = f"step {loaded.step}" if loaded.step is not None else "step unknown"
    return f"loaded {loaded.checkpoint} ({step}, {loaded.spec.name} {loaded.name})"
