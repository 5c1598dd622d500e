"""One loader for every consumer of a trained model (eval tasks, generation, analyses,
export): a checkpoint reference -> (family spec, config, model in eval mode, tokenizer).

A reference is any of
  - a step directory `.../step_000000200` (local or s3://), a DCP checkpoint of the trainer
    (any dp/tp layout: DCP reassembles the shards);
  - a checkpoint root (holding `latest`) or a run directory (holding `config.yaml`): the newest
    complete checkpoint of the folder given: its own `checkpoints/` first, then the root its
    config.yaml names when that lies outside it (S3, another disk); never the folder it was
    copied from (paths a run records are relative to it: io/run_folder.py);
  - a `model_final.pt` (the trainer's `checkpoint.export_final`: the full state dict), whose
    config comes from the `config.yaml` the trainer wrote beside it;
  - an export directory (`gpn-scale export`: safetensors + config.json + tokenizer, native or
    the Hugging Face Llama layout; eval/export.py).
The model config is the one the checkpoint was saved with (the manifest's `model_config`,
family from the registry), so no training YAML is needed; `model_config=` must name the same
family and shape. The tokenizer is the one the training data was built with: the identity
the trainer records in every checkpoint's manifest (kind, name, sha256, eod token; the
tokenizer.json itself travels in the step directory), else (older checkpoints,
`model_final.pt`) the dataset metadata (`gpn_dataset.json`) that the saved training config's
`data.remote` names; `tokenizer=` may replace the file (e.g. when it moved) but must be the
same tokenizer (sha256) where the checkpoint records one.
Nothing here is collective: one process loads the full weights.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpn_scale.core.config import ConfigError
from gpn_scale.eval.tokenizer import Tokenizer, from_identity, from_name
from gpn_scale.io.run_folder import FINAL_WEIGHTS, RUN_CONFIG, step_of
from gpn_scale.models.protocol import FamilySpec

TOKENIZER_FILE = "tokenizer.json"  # saved in every step directory (and export) when HF


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
        return _data_remote(self.meta.get("config"), self.run_dir)

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
    """(kind, uri): kind "dcp" (a step directory URI), "final" (a model_final.pt path) or
    "export" (a `gpn-scale export` directory)."""
    from gpn_scale.checkpoint import CheckpointManager
    from gpn_scale.eval.export_format import is_export_dir

    ref = str(ref).strip().rstrip("/") if str(ref).strip() not in ("", "/") else str(ref)
    if not ref:
        raise ConfigError("checkpoint: empty; give a step directory, run dir or model_final.pt")
    if ref.endswith(".pt"):
        if _is_local_missing(ref):
            raise ConfigError(f"checkpoint {ref}: no such file; fix the path")
        return "final", ref
    if step_of(ref) is not None:
        if _is_local_missing(ref):
            raise ConfigError(
                f"checkpoint {ref}: no such step folder (it is missing); give an existing "
                "step directory, or the run / checkpoint root for its newest checkpoint"
            )
        return "dcp", ref
    if _is_local_missing(ref):
        raise ConfigError(
            f"checkpoint {ref}: no such file or directory; give a step directory, a "
            "checkpoint root, a run directory, an export directory or a model_final.pt"
        )
    if "://" not in ref and is_export_dir(ref):
        return "export", ref
    for root in checkpoint_roots(ref):
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


def checkpoint_roots(ref: str) -> list[str]:
    """Where a folder's checkpoints may be, in order: the folder itself (a checkpoint root),
    its own `checkpoints/`, then the root its config.yaml names (resolved for where the
    folder lies now, so a copy never reads the original's)."""
    from gpn_scale.io.run_folder import is_run_folder, read_run_config

    roots = [ref]
    if "://" not in ref:
        roots.append(str(Path(ref) / "checkpoints"))
        if is_run_folder(ref):
            recorded = (read_run_config(ref).get("checkpoint") or {}).get("root")
            if recorded:
                roots.append(str(recorded))
    return list(dict.fromkeys(roots))


def _data_remote(train_cfg: dict[str, Any] | None, run_dir: str | None) -> str | None:
    """The dataset a run trained on, for the run folder where it lies now (None: unknown)."""
    from gpn_scale.io.run_folder import rebase_run_config

    if not isinstance(train_cfg, dict):
        return None
    if run_dir:
        train_cfg = rebase_run_config(train_cfg, run_dir)
    data = train_cfg.get("data") or {}
    remote = data.get("remote")
    if not remote:
        return None
    if remote == "default":  # the embedded corpus, built under the run folder
        base = train_cfg.get("run_dir") or ""
        return str(Path(base) / "data" / f"default_corpus_T{data.get('seq_len')}")
    return str(remote)


def _tokenizer_for(remote: str | None, where: str) -> Tokenizer:
    """The tokenizer of the dataset a run trained on (its metadata), byte for the default
    corpus when it is gone (data_tools/default_corpus.py always uses the byte tokenizer)."""
    from gpn_scale.data import DataError
    from gpn_scale.data.metadata import read_metadata

    if not remote:
        raise ConfigError(f"{where}: the saved config names no dataset; pass --tokenizer")
    if (
        remote.rstrip("/").rsplit("/", 1)[-1].startswith("default_corpus_T")
        and not (Path(remote) / "gpn_dataset.json").is_file()
    ):
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


@dataclass
class Source:
    """What a reference names, before any tensor is read."""

    kind: str  # "dcp" | "final" | "export"
    uri: str
    meta: dict[str, Any]  # the checkpoint's meta (model_config, tokenizer, config, step)
    run_dir: str | None  # the run folder it belongs to, where it lies now
    serialized_tokenizer: str | None = None  # the tokenizer.json that travels with it


def read_source(kind: str, uri: str) -> Source:
    """What the resolved reference (`resolve`) holds: its meta, run folder and tokenizer file."""
    from gpn_scale.checkpoint import CheckpointManager
    from gpn_scale.io.run_folder import checkpoint_run_dir, is_run_folder, read_run_config

    if kind == "dcp":
        parent = uri.rstrip("/").rsplit("/", 1)[0] or "/"
        mgr = CheckpointManager(parent)
        meta = mgr.read_meta(uri)
        raw = mgr.storage.get_bytes(f"{uri.rstrip('/').rsplit('/', 1)[-1]}/{TOKENIZER_FILE}")
        return Source(kind, uri, meta, checkpoint_run_dir(uri, meta), raw.decode() if raw else None)
    if kind == "export":
        from gpn_scale.eval.export_format import read_export_meta

        return Source(kind, uri, read_export_meta(uri), None)
    folder = str(Path(uri).parent)
    meta = {}
    if "://" not in uri and is_run_folder(folder):
        from gpn_scale.run.config import load_train_config
        from gpn_scale.run.model import model_config as run_model_config

        meta["config"] = read_run_config(folder)
        meta["model_config"] = run_model_config(load_train_config(folder)).to_dict()
    return Source(kind, uri, meta, folder if meta else None)


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


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two tokenizer identities name the same tokenizer (kind, serialisation, EOD)."""
    if a.get("kind") != b.get("kind"):
        return False
    if a.get("kind") == "huggingface" and a.get("sha256") and b.get("sha256"):
        if a["sha256"] != b["sha256"]:
            return False
    ea, eb = a.get("eod_token_id"), b.get("eod_token_id")
    return ea is None or eb is None or int(ea) == int(eb)


def describe_tokenizer(identity: dict[str, Any]) -> str:
    sha = str(identity.get("sha256") or "")[:12]
    return f"{identity.get('kind')}:{identity.get('name')}" + (f" (sha256 {sha})" if sha else "")


def _tokenizer(source: Source, override: str | None) -> Tokenizer:
    recorded = source.meta.get("tokenizer")
    where = f"checkpoint {source.uri} (tokenizer)"
    if override:
        tok = from_name(override)
        if isinstance(recorded, dict) and not same_tokenizer(tok.identity(), recorded):
            raise ConfigError(
                f"--tokenizer {override} ({describe_tokenizer(tok.identity())}) is not the "
                f"tokenizer {source.uri} was trained with ({describe_tokenizer(recorded)}); "
                "drop --tokenizer, or pass a copy of that tokenizer.json"
            )
        return tok
    if isinstance(recorded, dict):  # recorded by the trainer at save time
        if source.serialized_tokenizer and recorded.get("kind") == "huggingface":
            return from_identity(recorded, where=where, serialized=source.serialized_tokenizer)
        name = recorded.get("name")
        if source.kind == "export" and isinstance(name, str) and not os.path.isabs(name):
            recorded = {**recorded, "name": str(Path(source.uri) / name)}
        return from_identity(recorded, where=where)
    # older checkpoints, model_final.pt: the training data's metadata
    return _tokenizer_for(
        _data_remote(source.meta.get("config"), source.run_dir), f"checkpoint {source.uri}"
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
    explicit = str(ref).rstrip("/").endswith(".pt") or step_of(str(ref)) is not None
    for attempt in range(4):
        kind, uri = resolve(ref)
        try:
            return _load(kind, uri, dev, tokenizer, model_config, dtype, with_tokenizer)
        except CheckpointError:
            if explicit or kind != "dcp" or attempt == 3:
                raise
            parent = uri.rstrip("/").rsplit("/", 1)[0] or "/"
            if CheckpointManager(parent).is_complete(uri):
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
    from gpn_scale.checkpoint import CheckpointManager
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

    tok = _tokenizer(source, tokenizer) if with_tokenizer else None
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
    elif kind == "export":
        from gpn_scale.eval.export_format import read_export_weights

        state = read_export_weights(uri, spec, cfg)
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
    return LoadedModel(spec, cfg, model, tok, uri, step, dev, meta, source.run_dir)


def describe_loaded(loaded: LoadedModel) -> str:
    """The line the commands print on stderr: which weights they use."""
    step = f"step {loaded.step}" if loaded.step is not None else "step unknown"
    return f"loaded {loaded.checkpoint} ({step}, {loaded.spec.name} {loaded.name})"
