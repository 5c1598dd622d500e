"""CheckpointManager: sharded save/load with a manifest, an atomic "latest" pointer and retention.

Layout under the root (a directory or s3://bucket/prefix):

    <root>/latest                      {"step": 200, "name": "step_000000200"}  (written last)
    <root>/step_000000200/manifest.json  files + sizes + sha256 + world_size + step + meta
    <root>/step_000000200/.metadata      DCP metadata (rank 0)
    <root>/step_000000200/__<r>_0.distcp DCP shards, one file per rank
    <root>/step_000000200/rank_<r>.pt    per-rank state (RNG), weights_only-loadable
    (DeepSpeed checkpoints hold DeepSpeed's own files instead of the DCP ones.)

Commit protocol of `save` (all ranks call it):
 1. every rank writes its files into its own staging directory (for a local root the staging
    directory sits inside the root, so "upload" is a rename), hashes them and uploads them;
 2. the ranks all_gather their file lists (or their one-line errors: then every rank raises);
 3. rank 0 lists the uploaded files, checks every size, and only then writes manifest.json;
 4. rank 0 replaces the `latest` pointer, then applies keep-last-K retention.
A checkpoint without a manifest, or whose files do not match it, is never returned by latest().

Beside it: staging.py (where the ranks stage), writers.py (DCP, DeepSpeed and rank files into
the staging directory), loading.py (verified copy, then DCP or DeepSpeed reads), retention.py
(keep-last-K, pure), collective.py (the ranks' exchanges) and safe_load.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.api import CheckpointException

from gpn_scale.checkpoint import collective, writers
from gpn_scale.checkpoint.catalog import (
    FORMAT,
    check_step,
    find_latest,
    sha256_file,
    step_dirs,
    step_of,
)
from gpn_scale.checkpoint.errors import CheckpointDamaged, CheckpointError, one_line
from gpn_scale.checkpoint.loading import LoadedCheckpoint, load_dcp, load_deepspeed
from gpn_scale.checkpoint.retention import to_delete
from gpn_scale.checkpoint.roots import open_storage
from gpn_scale.checkpoint.staging import Staging
from gpn_scale.io.run_folder import LATEST, MANIFEST, STEP_DIR_RE, step_dir_name
from gpn_scale.io.storage import LocalStorage, Storage

T = TypeVar("T")


class CheckpointManager:
    """Save/find/load checkpoints under `root` (a directory or s3://bucket/prefix).

    rank and world size come from torch.distributed when it is initialised, else 0 / 1.
    `staging_dir`: where each rank writes before uploading (default: `<root>/.staging` for a local
    root, `$GPN_CKPT_STAGING` or the temp dir for S3); each rank uses its own `rank_<r>` sub-dir.
    `s3_retries` / `s3_backoff_s` bound the S3 retry loop (see S3Storage).
    """

    def __init__(
        self,
        root: str,
        *,
        keep_last: int = 3,
        staging_dir: str | None = None,
        s3_retries: int | None = None,
        s3_backoff_s: float | None = None,
    ) -> None:
        if not isinstance(keep_last, int) or keep_last < 1:
            raise CheckpointError(
                f"keep_last={keep_last!r} must be an integer >= 1 (it always keeps the latest)"
            )
        self.root = str(root)
        self._s3_options = {"retries": s3_retries, "backoff_s": s3_backoff_s}
        self.storage: Storage = open_storage(self.root, **self._s3_options)
        self.keep_last = keep_last
        self.skipped: list[tuple[str, str]] = []  # set by latest(): newer, incomplete ones
        self.note = ""  # set by latest(): a stale `latest` pointer passed over, said in a line
        self._staging = Staging(self.storage, staging_dir)

    # -- ranks and staging -------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return collective.rank()

    @property
    def world_size(self) -> int:
        return collective.world_size()

    @property
    def staging_root(self) -> Path:
        """Where the ranks stage their files (a local directory; see the class docstring)."""
        return self._staging.root

    def _stage(self) -> Path:
        return self._staging.rank_dir(self.rank)

    # -- locating -----------------------------------------------------------------------------

    def _locate(self, uri: str) -> tuple[Storage, str]:
        """(storage, step dir name) for a checkpoint URI under this root or anywhere else."""
        text = str(uri).rstrip("/")
        name = text.rsplit("/", 1)[-1]
        if not STEP_DIR_RE.match(name):
            raise CheckpointError(
                f"{uri!r} is not a checkpoint (expected .../step_NNNNNNNNN); use --resume auto "
                "or a step directory"
            )
        parent = text[: -len(name)].rstrip("/") or "/"
        mine = self.storage.uri.rstrip("/")
        if parent == mine or (
            isinstance(self.storage, LocalStorage) and os.path.abspath(parent) == mine
        ):
            return self.storage, name
        return open_storage(parent, **self._s3_options), name

    def latest(self, exclude: dict[str, str] | None = None) -> str | None:
        """URI of the newest complete checkpoint (the `latest` pointer if it verifies and no
        complete step directory of a higher step was written after it, else the highest
        complete step directory), or None when there is none. `exclude`: {name: reason} of
        step directories found damaged otherwise (by a load), never returned.

        `self.skipped` is then [(uri, reason)] for the step directories newer than the one
        returned that are not complete (damaged, or a save that did not finish), newest first;
        `self.note` one line when a stale pointer was passed over, else "".
        """
        uri, self.skipped, self.note = find_latest(self.storage, exclude)
        return uri

    def is_complete(self, uri: str) -> bool:
        """Whether the checkpoint at `uri` (under this root or another) is complete now."""
        storage, name = self._locate(uri)
        return check_step(storage, name)[0] is not None

    def list_checkpoints(self) -> list[tuple[int, str, bool]]:
        """(step, uri, complete) for every step directory, newest first (for status displays)."""
        out = []
        for name in step_dirs(self.storage):
            complete = check_step(self.storage, name)[0] is not None
            out.append((step_of(name), self.storage.child_uri(name), complete))
        return out

    def delete_all(self) -> list[str]:
        """Delete every step directory (manifest first) and the `latest` pointer; returns the
        names deleted. Not collective: call it on rank 0 (the trainer's --fresh)."""
        names = step_dirs(self.storage)
        for name in names:
            self._delete_step(name)
        self.storage.delete(LATEST)
        return names

    def resolve_resume(self, resume: str | None) -> str | None:
        """'auto' -> latest() (None when there is none); 'none'/'' -> None; a URI -> that URI
        if complete."""
        value = (resume or "none").strip()
        if value.lower() in ("none", "never", "no", "false", "off", ""):
            return None
        if value.lower() == "auto":
            return self.latest()
        storage, name = self._locate(value)
        manifest, reason = check_step(storage, name)
        if manifest is None:
            raise CheckpointError(
                f"cannot resume from {storage.child_uri(name)}: {reason}; pick a complete "
                "checkpoint or use --resume auto"
            )
        return storage.child_uri(name)

    def refuse_start_over(self) -> None:
        """After `latest()` found no complete checkpoint: raise when step directories whose
        save finished (they have a manifest) are there all the same, damaged. Only --fresh
        starts over them; directories of saves that never finished (no manifest) hold nothing
        to resume and stop nothing."""
        damaged = self._damaged(self.skipped)
        if damaged:
            raise self._nothing_loadable(damaged)

    def load_newest(self, uri: str, load: Callable[[str], T], log: Callable[[str], None]) -> T:
        """`--resume auto`'s load: `load(uri)`, and while that finds the checkpoint damaged
        (CheckpointDamaged: a file failing its sha256, a refused pickle), the newest complete
        checkpoint not tried yet, each fallback said by `log`. None left: the one-line error
        of `refuse_start_over`. Collective like `load`: the ranks agree on a load's errors, so
        every rank walks the same checkpoints."""
        bad: dict[str, str] = {}
        while True:
            try:
                return load(uri)
            except CheckpointDamaged as err:
                bad[self._locate(uri)[1]] = err.reason
                older = self.latest(exclude=bad)
                if older is None:
                    raise self._nothing_loadable(self._damaged(self.skipped)) from None
                log(f"resume auto: cannot load {uri}: {err.reason}; falling back to {older}")
                uri = older

    def _damaged(self, skipped: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Of `skipped`: the step directories whose save finished (a manifest is there)."""
        return [
            (uri, why)
            for uri, why in skipped
            if self.storage.exists(f"{uri.rstrip('/').rsplit('/', 1)[-1]}/{MANIFEST}")
        ]

    def _nothing_loadable(self, damaged: list[tuple[str, str]]) -> CheckpointError:
        named = "; ".join(f"{uri.rsplit('/', 1)[-1]}: {why}" for uri, why in damaged[:4])
        more = f"; and {len(damaged) - 4} more" if len(damaged) > 4 else ""
        return CheckpointError(
            f"resume auto: no checkpoint under {self.root} can be loaded, and starting over "
            f"would overwrite them ({named}{more}); restore the damaged files, pass --resume "
            "with a checkpoint that loads, or --fresh to delete them and start at step 0"
        )

    def read_meta(self, uri: str) -> dict[str, Any]:
        """The `meta` a checkpoint was saved with, from its manifest (not collective, cheap: no
        file checks; e.g. to compare model configs before building the state to load into)."""
        storage, name = self._locate(uri)
        raw = storage.get_bytes(f"{name}/{MANIFEST}")
        if raw is None:
            reason = check_step(storage, name)[1]
            raise CheckpointError(
                f"{storage.child_uri(name)}: {reason}; pick a complete checkpoint"
            )
        try:
            return dict(json.loads(raw).get("meta", {}))
        except (ValueError, AttributeError, TypeError) as exc:
            raise CheckpointError(
                f"{storage.child_uri(name)}/manifest.json is unreadable ({one_line(exc, 120)})"
            ) from exc

    def preflight(self) -> None:
        """Cheap write probe of the root and of this rank's staging directory (call before
        training)."""
        self.storage.preflight()
        stage = self._stage()
        try:
            stage.mkdir(parents=True, exist_ok=True)
            probe = stage / ".probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise CheckpointError(
                f"checkpoint staging directory {stage} is not writable ({one_line(exc, 120)}); "
                f"{self._staging.fix()}"
            ) from exc

    # -- saving -------------------------------------------------------------------------------

    def _begin(self, step: int, meta: dict[str, Any]) -> tuple[str, Path]:
        """Collective: validate, clear this rank's staging and (rank 0) any old dir for `step`."""
        name = step_dir_name(step)
        stage = self._stage() / name
        err = None
        try:
            if self.rank == 0:
                json.dumps(meta)
                if "step" in meta and meta["step"] != int(step):
                    raise CheckpointError(
                        f"meta says step {meta['step']!r}, the save is of step {step}; pass "
                        "the same step to both"
                    )
            shutil.rmtree(stage, ignore_errors=True)
            stage.mkdir(parents=True, exist_ok=True)
            if self.rank == 0 and self.storage.list(f"{name}/"):
                # Re-saving a step: drop the manifest first so the old copy is never half-valid.
                self.storage.delete_prefix(f"{name}/{MANIFEST}")
                self.storage.delete_prefix(f"{name}/")
        except TypeError as exc:
            err = f"meta is not JSON-serialisable ({one_line(exc, 160)}); pass plain python values"
        except CheckpointError as exc:
            err = str(exc)
        except OSError as exc:
            err = (
                f"cannot prepare staging directory {stage} ({one_line(exc, 160)}); "
                f"{self._staging.fix()}"
            )
        collective.agree(err, f"checkpoint {name} not saved")
        return name, stage

    def _upload_stage(self, name: str, stage: Path) -> str | dict[str, dict[str, Any]]:
        """Hash and upload every file this rank staged; {rel: entry} or a one-line error."""
        entries: dict[str, dict[str, Any]] = {}
        try:
            for path in sorted(p for p in stage.rglob("*") if p.is_file()):
                rel = path.relative_to(stage).as_posix()
                # fsync before the rename/upload: a manifest must never outlive its data in a crash.
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
                entry = {
                    "size": path.stat().st_size,
                    "sha256": sha256_file(path),
                    "rank": self.rank,
                }
                self.storage.put_file(path, f"{name}/{rel}")
                entries[rel] = entry
        except CheckpointError as exc:
            return str(exc)
        except OSError as exc:
            return f"cannot read staged file ({one_line(exc, 160)})"
        except Exception as exc:  # noqa: BLE001 - must reach the gather, or the other ranks hang
            return one_line(exc, 200)
        return entries

    def _commit(
        self,
        step: int,
        name: str,
        stage: Path,
        kind: str,
        per_rank: Any,
        meta: dict[str, Any],
        group: Any = None,
    ) -> str:
        """Collective (on `group`) tail of a save: gather file lists, rank 0 verifies +
        writes manifest/latest."""
        what = (
            f"checkpoint {name} not saved ({self.storage.child_uri(name)}); the previous "
            "latest is unchanged"
        )
        gathered = collective.gather(per_rank, group)
        for r, item in enumerate(gathered):
            if isinstance(item, str):
                where = f" on rank {r}" if self.world_size > 1 else ""
                shutil.rmtree(stage, ignore_errors=True)
                raise CheckpointError(f"{what}{where}: {item}")
        error = None
        if self.rank == 0:
            try:
                self._write_manifest(step, name, kind, gathered, meta)
            except CheckpointError as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - any surprise must still reach every rank
                error = one_line(exc)
        error = collective.broadcast(error, group)
        shutil.rmtree(stage, ignore_errors=True)
        if error:
            raise CheckpointError(f"{what}: {error}")
        return self.storage.child_uri(name)

    def _write_manifest(
        self, step: int, name: str, kind: str, gathered: list[Any], meta: dict[str, Any]
    ) -> None:
        files: dict[str, dict[str, Any]] = {}
        for entries in gathered:
            for rel, entry in entries.items():
                if rel in files:
                    raise CheckpointError(
                        f"ranks {files[rel]['rank']} and {entry['rank']} both wrote {rel}"
                    )
                files[rel] = entry
        # Verify what actually landed before anything may point at it.
        listing = self.storage.list(f"{name}/")
        for rel, entry in files.items():
            have = listing.get(f"{name}/{rel}")
            if have is None or have.size != entry["size"]:
                got = "missing" if have is None else f"{have.size} bytes"
                raise CheckpointError(
                    f"verification failed: {rel} is {got}, expected {entry['size']} bytes"
                )
            if have.etag:
                entry["etag"] = have.etag
            if have.mtime_ns is not None:
                entry["mtime_ns"] = have.mtime_ns
        manifest = {
            "format": FORMAT,
            "kind": kind,
            "step": int(step),
            "world_size": self.world_size,
            "created_unix": time.time(),
            "torch_version": torch.__version__,
            "files": dict(sorted(files.items())),
            "meta": meta,
        }
        # The manifest is the commit: from here the checkpoint is complete, and readers take the
        # newest complete one even past a stale pointer (catalog.find_latest). A pointer that
        # cannot be written is then said, not an unsaved checkpoint.
        self.storage.put_bytes(f"{name}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
        try:
            self.storage.put_bytes(LATEST, json.dumps({"step": int(step), "name": name}).encode())
        except Exception as exc:  # noqa: BLE001 - the checkpoint is committed; the pointer is a hint
            warnings.warn(
                f"checkpoint {name} is saved, but {LATEST} still names the one before "
                f"({one_line(exc)}); a resume takes the newest complete checkpoint, and the next "
                "save writes the pointer again",
                stacklevel=3,
            )
        try:
            self._retain(name)
        except Exception as exc:  # noqa: BLE001 - the checkpoint is safe; retention can catch up next save
            warnings.warn(
                f"checkpoint retention failed (will retry at the next save): {one_line(exc)}",
                stacklevel=3,
            )

    def _retain(self, current: str) -> None:
        """Keep the newest `keep_last` complete checkpoints (always `current`); delete older ones
        and abandoned partial directories older than `current`. Newer directories are left alone."""
        names = step_dirs(self.storage)  # newest first
        complete = [n for n in names if self.storage.get_bytes(f"{n}/{MANIFEST}") is not None]
        for n in to_delete(names, complete, current, self.keep_last):
            self._delete_step(n)

    def _delete_step(self, name: str) -> None:
        # Manifest first: a half-deleted checkpoint must look incomplete, never complete.
        self.storage.delete_prefix(f"{name}/{MANIFEST}")
        self.storage.delete_prefix(f"{name}/")

    def save(
        self,
        step: int,
        app_state: dict[str, Any],
        *,
        meta: dict[str, Any],
        rank_state: dict[str, Any] | None = None,
        files: dict[str, bytes] | None = None,
    ) -> str:
        """COLLECTIVE. Save a DCP state dict (+ per-rank state, + meta on rank 0); returns the URI.

        `files`: small files rank 0 adds to the step directory (name -> content; e.g. the
        tokenizer.json the weights were trained with), uploaded and hashed with the rest.

        The checkpoint becomes `latest` only after every rank's files are uploaded and verified.
        Any failure raises a one-line CheckpointError on every rank and leaves `latest` unchanged.
        """
        name, stage = self.begin_save(step, meta)
        return self.write_and_commit(
            step, name, stage, app_state, meta=meta, rank_state=rank_state, files=files
        )

    def begin_save(self, step: int, meta: dict[str, Any]) -> tuple[str, Path]:
        """COLLECTIVE (default group). The start of a save: meta checked, this rank's
        staging directory emptied, an older copy of the step removed; (name, staging dir)."""
        return self._begin(step, meta)

    def write_and_commit(
        self,
        step: int,
        name: str,
        stage: Path,
        app_state: dict[str, Any],
        *,
        meta: dict[str, Any],
        rank_state: dict[str, Any] | None = None,
        files: dict[str, bytes] | None = None,
        group: Any = None,
    ) -> str:
        """COLLECTIVE on `group` (None: the default group). The rest of `save` after
        `begin_save`: DCP's shards and the rank file into `stage`, hashed and uploaded, then
        the commit (manifest, then `latest`). A background save (async_save.py) runs this in
        its thread on a process group of its own, from a staged copy of the state."""
        err = None
        try:
            writers.write_dcp(app_state, stage, group)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises on every rank
            full = self._staging.disk_full(exc, stage)
            shutil.rmtree(stage, ignore_errors=True)
            raise CheckpointError(
                f"checkpoint {name} not saved: {full or f'DCP save failed ({one_line(exc)})'}"
            ) from exc
        try:
            writers.write_rank_files(stage, self.rank, rank_state, files)
        except Exception as exc:  # noqa: BLE001
            err = self._cannot_write(exc, stage)
        per_rank = err if err else self._upload_stage(name, stage)
        return self._commit(step, name, stage, "dcp", per_rank, meta, group)

    def _cannot_write(self, exc: BaseException, stage: Path) -> str:
        """The one line of a rank file (or an extra file) that could not be staged."""
        return self._staging.disk_full(exc, stage) or (
            f"cannot write rank_state ({one_line(exc, 160)})"
        )

    def save_deepspeed(
        self,
        step: int,
        engine: Any,
        *,
        meta: dict[str, Any],
        rank_state: dict[str, Any] | None = None,
        files: dict[str, bytes] | None = None,
    ) -> str:
        """COLLECTIVE. engine.save_checkpoint into this rank's staging dir, then
        upload/manifest/latest (`files`: as in `save`)."""
        name, stage = self._begin(step, meta)
        try:
            err = writers.write_deepspeed(engine, stage, name)
        except Exception as exc:  # noqa: BLE001
            err = self._staging.disk_full(exc, stage) or (
                f"DeepSpeed save_checkpoint failed ({one_line(exc, 200)})"
            )
        try:
            if not err:
                writers.write_rank_files(stage, self.rank, rank_state, files)
        except Exception as exc:  # noqa: BLE001
            err = self._cannot_write(exc, stage)
        per_rank = err if err else self._upload_stage(name, stage)
        return self._commit(step, name, stage, "deepspeed", per_rank, meta)

    # -- loading (loading.py) -----------------------------------------------------------------

    def load(self, uri: str, app_state: dict[str, Any]) -> LoadedCheckpoint:
        """COLLECTIVE when distributed. dcp.load into `app_state` in place (tensors and python
        values; the caller then applies it, e.g. with set_state_dict). Works on a different world
        size (DCP reshards); rank_state is then None."""
        storage, name = self._locate(uri)
        return load_dcp(storage, name, app_state, self._staging)

    def load_deepspeed(self, uri: str, engine: Any) -> LoadedCheckpoint:
        """COLLECTIVE. engine.load_checkpoint from the verified files (same world size only:
        DeepSpeed ZeRO shards cannot be re-split without converting to its universal format).
        Every file DeepSpeed reads is loaded with weights_only=True."""
        storage, name = self._locate(uri)
        return load_deepspeed(storage, name, engine, self._staging)
