"""Loading a checkpoint: a verified local copy of its files (collective: the ranks agree on
any damage, so none is left waiting), then DCP's or DeepSpeed's reader over it, every file
read without running pickled code (safe_load.py)."""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from gpn_scale.checkpoint import collective
from gpn_scale.checkpoint.catalog import check_step, sha256_file
from gpn_scale.checkpoint.errors import CheckpointDamaged, CheckpointError, one_line
from gpn_scale.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    deepspeed_safe_load,
    safe_torch_load,
    safe_unpickle_metadata,
)
from gpn_scale.checkpoint.staging import Staging
from gpn_scale.checkpoint.writers import rank_file
from gpn_scale.io.storage import Storage


@dataclass
class LoadedCheckpoint:
    """What `load`/`load_deepspeed` hand back besides the state loaded in place."""

    meta: dict[str, Any]
    rank_state: dict[str, Any] | None  # None when the saved world size differs from the current one
    step: int
    uri: str
    world_size: int = 1  # world size at save time
    kind: str = "dcp"  # "dcp" or "deepspeed"
    extra: dict[str, Any] = field(default_factory=dict)  # deepspeed: {"client_state": ...}


def load_dcp(
    storage: Storage, name: str, app_state: dict[str, Any], staging: Staging
) -> LoadedCheckpoint:
    """COLLECTIVE: CheckpointManager.load of step directory `name` of `storage`."""
    import torch.distributed.checkpoint as dcp

    manifest, local, downloaded = _materialise(storage, name, "dcp", staging)
    full_uri = storage.child_uri(name)
    try:
        # Vet DCP's pickled metadata ourselves first: DCP would hide our refusal inside its
        # own AssertionError text.
        metadata = safe_unpickle_metadata(
            (local / ".metadata").read_bytes(), str(local / ".metadata")
        )
    except OSError as exc:
        raise CheckpointError(
            f"cannot load {full_uri}: cannot read .metadata ({one_line(exc, 160)})"
        ) from exc
    # A tensor whose saved shape differs from the live one (another parameter layout or
    # model version) makes DCP fail deep inside a collective with a multi-line trace.
    mismatch = _first_shape_mismatch(app_state, metadata)
    if mismatch is not None:
        key, saved, live = mismatch
        raise CheckpointError(
            f"cannot load {full_uri}: {key} is {saved} in the checkpoint but {live} here "
            "(written by another version or layout of the model); resume it with the code "
            "that wrote it, or start a fresh checkpoint.root"
        )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(
                app_state,
                storage_reader=SafeFileSystemReader(str(local)),
                planner=SafeLoadPlanner(),
            )
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        cause = _find_checkpoint_error(exc)
        if cause is not None:
            raise _rewrapped(cause, f"cannot load {full_uri}") from exc
        raise CheckpointError(
            f"cannot load {full_uri}: DCP load failed ({one_line(exc)}); does the "
            "model/optimizer match the checkpoint?"
        ) from exc
    return _loaded(manifest, local, full_uri, "dcp", downloaded)


def load_deepspeed(storage: Storage, name: str, engine: Any, staging: Staging) -> LoadedCheckpoint:
    """COLLECTIVE: CheckpointManager.load_deepspeed of step directory `name` of `storage`."""
    manifest, local, downloaded = _materialise(storage, name, "deepspeed", staging)
    full_uri = storage.child_uri(name)
    if int(manifest.get("world_size", 1)) != collective.world_size():
        raise CheckpointError(
            f"cannot load {full_uri}: DeepSpeed checkpoint saved on "
            f"{manifest.get('world_size')} ranks, now "
            f"{collective.world_size()}; resume on the same number of ranks or convert it with "
            "ds_to_universal"
        )
    ckpt_engine = engine.checkpoint_engine
    original = ckpt_engine.load
    ckpt_engine.load = lambda path, map_location=None, **_: deepspeed_safe_load(path)
    try:
        load_path, client_state = engine.load_checkpoint(
            str(local.parent),
            tag=name,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001
        cause = _find_checkpoint_error(exc)
        if cause is not None:
            raise _rewrapped(cause, f"cannot load {full_uri}") from exc
        why = f"DeepSpeed load_checkpoint failed ({one_line(exc)})"
        raise CheckpointError(f"cannot load {full_uri}: {why}") from exc
    finally:
        ckpt_engine.load = original
    if load_path is None:
        raise CheckpointError(f"cannot load {full_uri}: DeepSpeed found no checkpoint in {local}")
    extra = {"client_state": client_state}
    return _loaded(manifest, local, full_uri, "deepspeed", downloaded, extra)


def _materialise(
    storage: Storage, name: str, kind: str, staging: Staging
) -> tuple[dict[str, Any], Path, bool]:
    """Collective: verified manifest + a local directory holding the checkpoint's files.

    Returns (manifest, local_dir, downloaded). Every file is hashed once: local roots split
    the hashing across ranks; S3 downloads are hashed by the downloader. Damage (check_step's
    reasons, a sha256 mismatch) raises CheckpointDamaged on every rank.
    """
    err, damaged = None, False
    manifest: dict[str, Any] | None = None
    local = storage.local_dir(name)
    downloaded = local is None
    try:
        manifest, reason = check_step(storage, name)
        if manifest is None:
            err, damaged = reason, True
        elif manifest.get("kind") != kind:
            err = (
                f"it is a {manifest.get('kind')} checkpoint; load it with the matching load method"
            )
        else:
            local, err = _verified_files(storage, name, manifest["files"], local, staging)
            damaged = err is not None
    except CheckpointError as exc:
        err = str(exc)
    except Exception as exc:  # noqa: BLE001 - must reach the gather, or the other ranks hang
        err = one_line(exc, 200)
    full_uri = storage.child_uri(name)
    results = collective.gather((err, damaged, full_uri))
    if downloaded and local is not None and any(e for e, _, _ in results):
        shutil.rmtree(local.parent, ignore_errors=True)  # this load's own download folder
    for r, (rank_err, bad, _) in enumerate(results):
        if rank_err:
            where = f" (rank {r})" if collective.world_size() > 1 else ""
            if bad:
                raise CheckpointDamaged(
                    f"cannot load {full_uri}{where}: {rank_err}; pick a complete checkpoint "
                    "or use --resume auto",
                    reason=rank_err,
                )
            raise CheckpointError(f"cannot load {full_uri}{where}: {rank_err}")
    uris = sorted({u for _, _, u in results})
    if len(uris) > 1:
        raise CheckpointError(
            f"ranks asked to load different checkpoints ({', '.join(uris)}); resolve the "
            "URI once "
            "(e.g. on rank 0) and pass the same one to every rank"
        )
    assert manifest is not None and local is not None
    return manifest, local, downloaded


def _verified_files(
    storage: Storage, name: str, files: dict[str, Any], local: Path | None, staging: Staging
) -> tuple[Path, str | None]:
    """(the local directory holding the checkpoint's files, the first damage found or
    None): an S3 checkpoint's files downloaded (kept when already there and matching) and
    hashed; a local root's files hashed where they are, split across the ranks."""
    if local is None:
        local = staging.download_dir(collective.rank()) / name
        for rel, entry in files.items():
            dest = local / rel
            if not (
                dest.exists()
                and dest.stat().st_size == entry["size"]
                and sha256_file(dest) == entry["sha256"]
            ):
                storage.get_file(f"{name}/{rel}", dest)
                if sha256_file(dest) != entry["sha256"]:
                    return local, f"downloaded {rel} does not match its sha256 in the manifest"
        return local, None
    rank, world = collective.rank(), collective.world_size()
    for i, (rel, entry) in enumerate(sorted(files.items())):
        if i % world == rank and sha256_file(local / rel) != entry["sha256"]:
            return local, f"file {rel} does not match its sha256 in the manifest"
    return local, None


def _loaded(
    manifest: dict[str, Any],
    local: Path,
    uri: str,
    kind: str,
    downloaded: bool,
    extra: dict[str, Any] | None = None,
) -> LoadedCheckpoint:
    """Collective: this rank's rank_state (when the world size matches) + the rest; then
    this load's download folder removed (`downloaded`)."""
    try:
        saved_world = int(manifest.get("world_size", 1))
        rank_state, err, damaged = None, None, False
        mine = rank_file(collective.rank())
        try:
            if saved_world == collective.world_size() and mine in manifest["files"]:
                rank_state = safe_torch_load(local / mine)
        except CheckpointError as exc:
            err, damaged = str(exc), isinstance(exc, CheckpointDamaged)
        collective.agree(err, f"cannot load {uri}", damaged)
        return LoadedCheckpoint(
            meta=manifest.get("meta", {}),
            rank_state=rank_state,
            step=int(manifest["step"]),
            uri=uri,
            world_size=saved_world,
            kind=kind,
            extra=dict(extra or {}),
        )
    finally:
        if downloaded:
            shutil.rmtree(local.parent, ignore_errors=True)


def _find_checkpoint_error(exc: BaseException) -> CheckpointError | None:
    """DCP wraps per-rank failures (CheckpointException); dig out our own refusal."""
    stack: list[Any] = [exc]
    seen = 0
    while stack and seen < 50:
        e = stack.pop()
        seen += 1
        if isinstance(e, CheckpointError):
            return e
        if isinstance(e, BaseException):
            stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)
            failures = getattr(e, "failures", None)
            if isinstance(failures, dict):
                stack.extend(failures.values())
        elif isinstance(e, tuple):  # DCP keeps (exception, traceback) pairs
            stack.extend(x for x in e if isinstance(x, BaseException))
    return None


def _rewrapped(cause: CheckpointError, what: str) -> CheckpointError:
    """`cause` under `what: `, still CheckpointDamaged when it was (a refused pickle)."""
    if isinstance(cause, CheckpointDamaged):
        return CheckpointDamaged(f"{what}: {cause}", reason=cause.reason)
    return CheckpointError(f"{what}: {cause}")


def _first_shape_mismatch(
    app_state: dict[str, Any], metadata: Any
) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """(key, saved shape, live shape) of the first tensor of `app_state` (nested dicts, keys
    joined with "." as DCP flattens them; a DTensor by its global shape) whose shape the
    checkpoint records differently; None when all agree or the key is not in the checkpoint."""
    saved = getattr(metadata, "state_dict_metadata", {}) or {}

    def walk(prefix: str, value: Any) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
        if isinstance(value, dict):
            for k, v in value.items():
                found = walk(f"{prefix}.{k}" if prefix else str(k), v)
                if found is not None:
                    return found
        elif isinstance(value, torch.Tensor):
            size = getattr(saved.get(prefix), "size", None)
            if size is not None and tuple(size) != tuple(value.shape):
                return prefix, tuple(size), tuple(value.shape)
        return None

    return walk("", app_state)
