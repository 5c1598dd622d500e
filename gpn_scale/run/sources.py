"""Checkpoint sources: what a checkpoint reference is, resolving it, reading its weights and
its tokenizer identity. The one reader of them for the trainer (warm start, the data check of
a resume), evaluation, generation, analyses and export.

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
    the Hugging Face Llama layout; run/export_format.py).
`resolve` names its kind and place, `read_source` what it holds before any tensor is read (the
model config it was saved with, its meta, the run folder it belongs to), `read_weights` its
weights. The tokenizer is the one the training data was built with: the identity the trainer
records in every checkpoint's manifest (kind, name, sha256, eod token; `tokenizer_record`:
the tokenizer.json itself travels in the step directory), else (older checkpoints,
`model_final.pt`) the dataset metadata (`gpn_dataset.json`) that the saved training config's
`data.remote` names (`tokenizer_of`).
Nothing here is collective: one process reads the full weights.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpn_scale.core.config import ConfigError
from gpn_scale.data.tokenizer import TOKENIZER_FILE, Tokenizer, from_identity, from_name
from gpn_scale.io.run_folder import (
    CHECKPOINTS,
    DEFAULT_CORPUS,
    FINAL_WEIGHTS,
    checkpoint_run_dir,
    default_corpus_dir,
    is_default_corpus,
    is_run_folder,
    read_run_config,
    rebase_run_config,
    step_of,
)

if TYPE_CHECKING:
    import torch
    from torch import nn


def _is_local_missing(ref: str) -> bool:
    return "://" not in ref and not os.path.exists(ref)


def resolve(ref: str) -> tuple[str, str]:
    """(kind, uri): kind "dcp" (a step directory URI), "final" (a model_final.pt path) or
    "export" (a `gpn-scale export` directory); one ConfigError line when `ref` names none."""
    from gpn_scale.checkpoint import CheckpointManager
    from gpn_scale.run.export_format import is_export_dir

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


def is_explicit(ref: str) -> bool:
    """Whether `ref` names its weights itself (a step directory or a .pt file), not a folder
    whose newest checkpoint may change while it is read."""
    return str(ref).rstrip("/").endswith(".pt") or step_of(str(ref)) is not None


def checkpoint_roots(ref: str) -> list[str]:
    """Where a folder's checkpoints may be, in order: the folder itself (a checkpoint root),
    its own `checkpoints/`, then the root its config.yaml names (resolved for where the
    folder lies now, so a copy never reads the original's)."""
    roots = [ref]
    if "://" not in ref:
        roots.append(str(Path(ref) / CHECKPOINTS))
        if is_run_folder(ref):
            recorded = (read_run_config(ref).get("checkpoint") or {}).get("root")
            if recorded:
                roots.append(str(recorded))
    return list(dict.fromkeys(roots))


def root_of(step_uri: str) -> str:
    """The checkpoint root holding the step directory `step_uri`."""
    return step_uri.rstrip("/").rsplit("/", 1)[0] or "/"


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

    if kind == "dcp":
        mgr = CheckpointManager(root_of(uri))
        meta = mgr.read_meta(uri)
        raw = mgr.storage.get_bytes(f"{uri.rstrip('/').rsplit('/', 1)[-1]}/{TOKENIZER_FILE}")
        return Source(kind, uri, meta, checkpoint_run_dir(uri, meta), raw.decode() if raw else None)
    if kind == "export":
        from gpn_scale.run.export_format import read_export_meta

        return Source(kind, uri, read_export_meta(uri), None)
    folder = str(Path(uri).parent)
    meta = {}
    if "://" not in uri and is_run_folder(folder):
        from gpn_scale.run.config import load_train_config
        from gpn_scale.run.model import model_config as run_model_config

        meta["config"] = read_run_config(folder)
        meta["model_config"] = run_model_config(load_train_config(folder)).to_dict()
    return Source(kind, uri, meta, folder if meta else None)


def open_source(ref: str) -> Source:
    """`read_source` of what `ref` resolves to."""
    return read_source(*resolve(ref))


def read_weights(source: Source, model: nn.Module, spec: Any, cfg: Any) -> dict[str, torch.Tensor]:
    """The state dict of `model` (family `spec`, config `cfg`) that `source` holds: a DCP
    step directory read into the model's own state dict (DCP reassembles any dp/tp layout;
    a DeepSpeed checkpoint is refused by the checkpoint manager in one line), an export's
    safetensors (either layout), a model_final.pt (read without running pickled code)."""
    if source.kind == "dcp":
        from gpn_scale.checkpoint import CheckpointManager

        state = model.state_dict()
        CheckpointManager(root_of(source.uri)).load(source.uri, {"model": state})
        return state
    if source.kind == "export":
        from gpn_scale.run.export_format import read_export_weights

        return read_export_weights(source.uri, spec, cfg)
    return _weights_from_final(source.uri)


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


# ----------------------------------------------------------------------------- the tokenizer


def tokenizer_record(identity: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(the tokenizer identity every checkpoint records, the files it carries): a Hugging
    Face tokenizer's tokenizer.json travels in each step directory (checked against the
    dataset's sha256), so eval, generation and export need neither the training data nor
    the file at its recorded path (a relative one is made absolute while it resolves)."""
    identity = dict(identity)
    if identity.get("kind") != "huggingface":
        return identity, {}
    name = str(identity.get("name") or "")
    if name and not os.path.isabs(name) and os.path.exists(os.path.expanduser(name)):
        identity["name"] = os.path.abspath(os.path.expanduser(name))
    try:
        text = from_identity(identity, where="the training data's tokenizer").serialized()
    except ConfigError:  # not at hand here: the identity alone (the data is tokenized)
        return identity, {}
    return identity, ({TOKENIZER_FILE: text.encode()} if text else {})


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


def training_data(train_cfg: dict[str, Any] | None, run_dir: str | None) -> str | None:
    """The dataset a run trained on (its saved config's data.remote), for the run folder
    where it lies now (None: unknown)."""
    if not isinstance(train_cfg, dict):
        return None
    if run_dir:
        train_cfg = rebase_run_config(train_cfg, run_dir)
    data = train_cfg.get("data") or {}
    remote = data.get("remote")
    if not remote:
        return None
    if remote == DEFAULT_CORPUS:  # the embedded corpus, built under the run folder
        return str(default_corpus_dir(train_cfg.get("run_dir") or "", data.get("seq_len")))
    return str(remote)


def tokenizer_of(source: Source, override: str | None = None) -> Tokenizer:
    """The tokenizer `source` was trained with: `override` ("byte" or a tokenizer.json path)
    when given, which must be the same tokenizer where the checkpoint records one; else the
    recorded identity (with the tokenizer.json that travels with it), else the training
    data's (older checkpoints, model_final.pt)."""
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
    return _data_tokenizer(
        training_data(source.meta.get("config"), source.run_dir), f"checkpoint {source.uri}"
    )


def _data_tokenizer(remote: str | None, where: str) -> Tokenizer:
    """The tokenizer of the dataset a run trained on (its metadata), byte for the default
    corpus when it is gone (data_tools/default_corpus.py always uses the byte tokenizer)."""
    from gpn_scale.data import METADATA_FILE, DataError
    from gpn_scale.data.metadata import read_metadata

    if not remote:
        raise ConfigError(f"{where}: the saved config names no dataset; pass --tokenizer")
    if is_default_corpus(remote) and not (Path(remote) / METADATA_FILE).is_file():
        return from_name("byte")
    try:
        meta = read_metadata(str(remote))
    except DataError as err:
        raise ConfigError(
            f"{where}: cannot read the training data's tokenizer ({err}); pass --tokenizer "
            "byte or --tokenizer PATH/tokenizer.json"
        ) from None
    return from_identity(meta.tokenizer, where=f"{remote} (tokenizer)")
