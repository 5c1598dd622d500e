"""One loader for every consumer of a trained model (eval tasks, generation, analyses):
a checkpoint reference -> (family spec, config, model in eval mode, tokenizer).

A reference is any of
  - a step directory `.../step_000000200` (local or s3://), a DCP checkpoint of the trainer;
  - a checkpoint root (holding `latest`) or a run directory (holding `config.yaml` and
    `checkpoints/`, or only `model_final.pt`): the newest complete checkpoint in it;
  - a `model_final.pt` (the trainer's `checkpoint.export_final`: the full state dict), whose
    config comes from the `config.yaml` the trainer wrote beside it.
The model config is the one the checkpoint was saved with (the manifest's `model_config`,
family from the registry), so no training YAML is needed. The tokenizer is the one the
training data was built with: the identity the trainer records in every checkpoint's
manifest (kind, name, sha256, eod token), else (older checkpoints, `model_final.pt`) the
dataset metadata (`gpn_dataset.json`) that the saved training config's `data.remote`
names; `tokenizer=` overrides both (e.g. when the tokenizer file moved).
Nothing here is collective: one process loads the full weights (DCP reassembles any sharding).
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpn_scale.core.config import ConfigError
from gpn_scale.eval.tokenizer import Tokenizer, from_identity, from_name
from gpn_scale.models.protocol import FamilySpec

_STEP_RE = re.compile(r"^step_(\d{9,})$")
FINAL_WEIGHTS = "model_final.pt"
RUN_CONFIG = "config.yaml"


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

    @property
    def tokenizer(self) -> Tokenizer:
        if self.loaded_tokenizer is None:
            raise ConfigError(f"checkpoint {self.checkpoint}: loaded without its tokenizer")
        return self.loaded_tokenizer

    @property
    def name(self) -> str:
        return str(getattr(self.config, "name", "") or self.spec.name)


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: CUDA is not available here; use --device cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r}: expected auto, cpu, cuda or cuda:N") from None


def _is_local_missing(ref: str) -> bool:
    return "://" not in ref and not os.path.exists(ref)


def resolve(ref: str) -> tuple[str, str]:
    """(kind, uri): kind "dcp" (a step directory URI) or "final" (a model_final.pt path)."""
    from gpn_scale.checkpoint import CheckpointManager

    ref = str(ref).strip().rstrip("/") if str(ref).strip() not in ("", "/") else str(ref)
    if not ref:
        raise ConfigError("checkpoint: empty; give a step directory, run dir or model_final.pt")
    if ref.endswith(".pt"):
        if _is_local_missing(ref):
            raise ConfigError(f"checkpoint {ref}: no such file; fix the path")
        return "final", ref
    if _STEP_RE.match(ref.rsplit("/", 1)[-1]):
        if _is_local_missing(ref):
            raise ConfigError(f"checkpoint {ref}: no such directory; fix the path")
        return "dcp", ref
    if _is_local_missing(ref):
        raise ConfigError(
            f"checkpoint {ref}: no such file or directory; give a step directory, a "
            "checkpoint root, a run directory or a model_final.pt"
        )
    roots = [ref]
    if "://" not in ref:
        run_cfg = Path(ref) / RUN_CONFIG
        if run_cfg.is_file():  # a run dir: its checkpoint root may be elsewhere (S3)
            roots.append(_train_config(run_cfg).resolved_checkpoint_root)
        roots.append(str(Path(ref) / "checkpoints"))
    for root in dict.fromkeys(roots):
        if "://" not in root and not os.path.isdir(root):
            continue
        latest = CheckpointManager(root).latest()
        if latest is not None:
            return "dcp", latest
    if "://" not in ref and (Path(ref) / FINAL_WEIGHTS).is_file():
        return "final", str(Path(ref) / FINAL_WEIGHTS)
    raise ConfigError(
        f"checkpoint {ref}: no complete checkpoint (nor {FINAL_WEIGHTS}) in it; give a step "
        "directory, a checkpoint root, a run directory or a model_final.pt"
    )


def _train_config(path: Path | str) -> Any:
    from gpn_scale.train.config import load_train_config

    return load_train_config(str(path))


def _tokenizer_for(train_cfg: dict[str, Any] | None, where: str) -> Tokenizer:
    """The tokenizer of the dataset a run trained on (its metadata), byte for the default
    corpus (data_tools/default_corpus.py always uses the byte tokenizer)."""
    from gpn_scale.data import DataError
    from gpn_scale.data.metadata import read_metadata

    data = (train_cfg or {}).get("data") or {}
    remote = data.get("remote")
    if not remote:
        raise ConfigError(f"{where}: the saved config names no dataset; pass --tokenizer")
    if remote == "default":
        run_dir = (train_cfg or {}).get("run_dir") or ""
        built = Path(run_dir) / "data" / f"default_corpus_T{data.get('seq_len')}"
        remote = str(built)
        if not (built / "gpn_dataset.json").is_file():
            return from_name("byte")
    try:
        meta = read_metadata(str(remote))
    except DataError as err:
        raise ConfigError(
            f"{where}: cannot read the training data's tokenizer ({err}); pass --tokenizer "
            "byte or --tokenizer PATH/tokenizer.json"
        ) from None
    return from_identity(meta.tokenizer, where=f"{remote} (tokenizer)")


def _weights_from_final(path: str) -> dict[str, torch.Tensor]:
    from gpn_scale.checkpoint.safe_load import safe_torch_load

    if path.startswith("s3://"):
        from gpn_scale.checkpoint import open_storage

        parent, _, name = path.rpartition("/")
        tmp = Path(tempfile.mkdtemp(prefix="gpn_eval_")) / name
        open_storage(parent).get_file(name, tmp)
        try:
            return dict(safe_torch_load(tmp))
        finally:
            tmp.unlink(missing_ok=True)
    return dict(safe_torch_load(Path(path)))


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

    `tokenizer`: "byte" or a tokenizer.json path instead of the dataset's; `model_config`:
    a model config name / YAML instead of the saved one (a model_final.pt without its run's
    config.yaml needs it). `with_tokenizer=False`: for a caller that reads its own data's
    tokenizer (the analyses), so the training data need not be reachable. A one-line
    ConfigError for anything that does not fit.
    """
    from gpn_scale.checkpoint import CheckpointManager
    from gpn_scale.models.registry import config_from_dict, load_model_config

    dev = device if isinstance(device, torch.device) else pick_device(device)
    kind, uri = resolve(ref)
    meta: dict[str, Any] = {}
    train_cfg: dict[str, Any] | None = None
    step: int | None = None
    if kind == "dcp":
        parent = uri.rstrip("/").rsplit("/", 1)[0] or "/"
        mgr = CheckpointManager(parent)
        meta = mgr.read_meta(uri)
        train_cfg = meta.get("config")
        step = int(meta["step"]) if "step" in meta else None
    else:
        run_cfg = Path(uri).parent / RUN_CONFIG
        if "://" not in uri and run_cfg.is_file():
            cfg_obj = _train_config(run_cfg)
            train_cfg = cfg_obj.to_dict()
            if model_config is None:
                from gpn_scale.train.preflight import model_config as run_model_config

                meta["model_config"] = run_model_config(cfg_obj).to_dict()
        elif model_config is None:
            raise ConfigError(
                f"checkpoint {uri}: no {RUN_CONFIG} beside it to name the model; pass "
                "--model-config NAME (and --tokenizer)"
            )
    if model_config is not None:
        spec, cfg = load_model_config(model_config)
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

    tok: Tokenizer | None = None
    if with_tokenizer:
        if tokenizer:
            tok = from_name(tokenizer)
        elif isinstance(meta.get("tokenizer"), dict):  # recorded by the trainer at save time
            tok = from_identity(meta["tokenizer"], where=f"checkpoint {uri} (tokenizer)")
        else:  # older checkpoints, model_final.pt: the training data's metadata
            tok = _tokenizer_for(train_cfg, f"checkpoint {uri}")
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    if tok is not None and vocab and tok.vocab_size > vocab:
        raise ConfigError(
            f"tokenizer {tok.name} has {tok.vocab_size} ids but the model's vocab_size is "
            f"{vocab}; pass the tokenizer the model was trained with (--tokenizer)"
        )

    model = spec.build(cfg)
    if kind == "dcp":
        sd = model.state_dict()
        mgr = CheckpointManager(uri.rstrip("/").rsplit("/", 1)[0] or "/")
        try:
            mgr.load(uri, {"model": sd})
        except ConfigError as err:
            if "it is a deepspeed checkpoint" not in str(err):
                raise
            raise ConfigError(
                f"checkpoint {uri} is a DeepSpeed checkpoint, which only a DeepSpeed engine "
                f"reads; evaluate the run's {FINAL_WEIGHTS} (checkpoint.export_final=true)"
            ) from None
        state = sd
    else:
        state = _weights_from_final(uri)
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
    return LoadedModel(spec, cfg, model, tok, uri, step, dev, meta)
