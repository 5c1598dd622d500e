"""Checkpoints: sharded save/load to a directory or S3, with a manifest and an atomic "latest".

Public API (the trainer codes against exactly these names)::

    from gpn_scale.checkpoint import (CheckpointManager, CheckpointError, LoadedCheckpoint,
                                      open_storage)

    ckpt = CheckpointManager("s3://bucket/runs/r1/ckpt", keep_last=3)   # or a local directory
    ckpt.preflight()                   # before any training work: bad path/credentials/endpoint
    uri = ckpt.resolve_resume("auto")  # "auto" -> latest() | "none" -> None | URI -> validated
    if uri:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        app = {"model": model_sd, "optim": optim_sd}
        loaded = ckpt.load(uri, app)   # COLLECTIVE; fills `app` in place (reshards if needed)
        set_state_dict(model, optimizer, model_state_dict=app["model"],
                       optim_state_dict=app["optim"])
        loaded.meta, loaded.step, loaded.rank_state   # rank_state None if the world size changed
    ...
    model_sd, optim_sd = get_state_dict(model, optimizer)
    ckpt.save(step, {"model": model_sd, "optim": optim_sd},            # COLLECTIVE
              meta={"step": step, "tokens": n, "loader": loader_state, "wandb_run_id": rid,
                    "config": cfg},
              rank_state=capture_rng_state())
    # DeepSpeed: ckpt.save_deepspeed(step, engine, meta=..., rank_state=...)
    #            ckpt.load_deepspeed(uri, engine)

- `CheckpointError(ConfigError)`: every failure, one line naming the problem and the fix;
  `CheckpointDamaged(CheckpointError)` when it is the checkpoint's own files (missing, not
  matching the manifest, refused pickles): another checkpoint may load.
- `open_storage(uri) -> Storage`: LocalStorage(dir) or S3Storage(bucket, prefix) from
  gpn_scale.io, the storage layer the data pipeline uses too (boto3; endpoint from
  S3_ENDPOINT_URL, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL; multipart; bounded exponential
  backoff on transient errors (GPN_S3_RETRIES, GPN_S3_BACKOFF_S); immediate failure on auth
  errors / missing bucket), raising CheckpointError.
- `CheckpointManager(root, *, keep_last=3, staging_dir=None, s3_retries=None, s3_backoff_s=None)`:
  `preflight()`, `save(step, app_state, *, meta, rank_state=None) -> uri`,
  `save_deepspeed(step, engine, *, meta, rank_state=None) -> uri`, `latest() -> uri | None`,
  `load(uri, app_state) -> LoadedCheckpoint`, `load_deepspeed(uri, engine) -> LoadedCheckpoint`,
  `resolve_resume(resume) -> uri | None`, `read_meta(uri) -> dict`, `list_checkpoints()`;
  for `--resume auto`: `refuse_start_over()` (no complete checkpoint, damaged ones there: a
  one-line error) and `load_newest(uri, load, log)` (a damaged one falls back to the next).
- `LoadedCheckpoint(meta, rank_state, step, uri, world_size, kind, extra)`.
- `capture_rng_state() -> dict` / `restore_rng_state(state)`: python, numpy, torch CPU (and CUDA)
  RNG states as weights_only-loadable values, for `rank_state`.

meta must be JSON-serialisable (it is stored in manifest.json). Loading never unpickles code:
DCP tensors and values, DCP metadata, rank files and DeepSpeed files are all read with
weights_only / an allow-list unpickler, and every file is checked against its sha256 first.
See docs/checkpoints.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gpn_scale.checkpoint.errors import CheckpointDamaged, CheckpointError
from gpn_scale.checkpoint.roots import open_storage
from gpn_scale.io.run_folder import step_dir_name
from gpn_scale.io.storage import LocalStorage, ObjectInfo, S3Storage, Storage

if TYPE_CHECKING:
    from gpn_scale.checkpoint.loading import LoadedCheckpoint
    from gpn_scale.checkpoint.manager import CheckpointManager
    from gpn_scale.checkpoint.rng import capture_rng_state, restore_rng_state

# The names that need torch load on first use, so that the torch-free parts of the package
# (its roots' storage, leases and errors: what `gpn-scale sweep` and slurm/train.sbatch read
# on a login or batch node) import in a tenth of a second rather than torch's ~3 s.
_LAZY = {
    "CheckpointManager": "gpn_scale.checkpoint.manager",
    "LoadedCheckpoint": "gpn_scale.checkpoint.loading",
    "capture_rng_state": "gpn_scale.checkpoint.rng",
    "restore_rng_state": "gpn_scale.checkpoint.rng",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointDamaged",
    "CheckpointError",
    "CheckpointManager",
    "LoadedCheckpoint",
    "LocalStorage",
    "ObjectInfo",
    "S3Storage",
    "Storage",
    "capture_rng_state",
    "open_storage",
    "restore_rng_state",
    "step_dir_name",
]
