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
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from gpn_scale.checkpoint.catalog import (
    FORMAT,
    check_step,
    find_latest,
    sha256_file,
    step_dirs,
    step_of,
)
from gpn_scale.checkpoint.errors import CheckpointDamaged, CheckpointError, one_line
from gpn_scale.checkpoint.roots import open_storage
from gpn_scale.checkpoint.safe_load import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    safe_torch_load,
    safe_unpickle_metadata,
)
from gpn_scale.io.run_folder import LATEST, MANIFEST, STEP_DIR_RE, step_dir_name
from gpn_scale.io.storage import LocalStorage, Storage

T = TypeVar("T")


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


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
        self._staging_given = staging_dir is not None
        if staging_dir is not None:
            self._staging_root = Path(staging_dir).expanduser().absolute()
        elif isinstance(self.storage, LocalStorage):
            self._staging_root = self.storage.root / ".staging"
        else:
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.storage.uri.removeprefix("s3://"))
            base = os.environ.get("GPN_CKPT_STAGING") or os.path.join(
                tempfile.gettempdir(), "gpn_scale_ckpt_staging"
            )
            self._staging_root = Path(base) / safe

    # -- distributed helpers ------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def _gather(self, obj: Any, group: Any = None) -> list[Any]:
        """all_gather_object on `group` (None: the default group; a background save passes
        its own, so it never meets the training's collectives on the same group)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def _broadcast(self, obj: Any, group: Any = None) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def _agree(self, error: str | None, what: str, damaged: bool = False) -> list[Any]:
        """Collective: raise the first rank's error on every rank (so no rank is left waiting);
        as CheckpointDamaged when that rank found the checkpoint's files `damaged`."""
        errors = self._gather((error, damaged))
        for r, (err, bad) in enumerate(errors):
            if err:
                where = f" on rank {r}" if self.world_size > 1 else ""
                if bad:
                    raise CheckpointDamaged(f"{what}{where}: {err}", reason=err)
                raise CheckpointError(f"{what}{where}: {err}")
        return [err for err, _ in errors]

    @property
    def staging_root(self) -> Path:
        """Where the ranks stage their files (a local directory; see the class docstring)."""
        return self._staging_root

    def _stage(self) -> Path:
        return self._staging_root / f"rank_{self.rank:05d}"

    def _staging_fix(self) -> str:
        """The setting a user changes for a writable staging directory: the trainer's key or
        variable, not this class's argument (which only a library caller passes)."""
        if self._staging_given:
            return "pass a writable staging_dir"
        if isinstance(self.storage, LocalStorage):  # <root>/.staging: the root itself
            return (
                "make checkpoint.root writable, or set checkpoint.root=DIR to a writable "
                "directory (its .staging holds each save)"
            )
        return "set GPN_CKPT_STAGING to a writable local directory"

    def _download_dir(self) -> Path:
        """A new directory of its own for one load's downloads (removed after the load): two
        readers of one S3 checkpoint on a machine (evals, a resume) share the staging root,
        but never their files, so neither deletes them under the other. Those of processes
        gone from this host (a load that failed) are removed here."""
        stage, prefix = self._stage(), f"load-{socket.gethostname()}-"
        stage.mkdir(parents=True, exist_ok=True)
        for old in stage.glob(f"{prefix}*"):
            pid = old.name[len(prefix) :].split("-")[0]
            if pid.isdigit() and not _process_alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=stage))

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
            self.storage.delete_prefix(f"{name}/{MANIFEST}")
            self.storage.delete_prefix(f"{name}/")
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
                f"{self._staging_fix()}"
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
                f"{self._staging_fix()}"
            )
        self._agree(err, f"checkpoint {name} not saved")
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
        gathered = self._gather(per_rank, group)
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
        error = self._broadcast(error, group)
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
        cur_step = step_of(current)
        names = step_dirs(self.storage)  # newest first
        complete = [n for n in names if self.storage.get_bytes(f"{n}/{MANIFEST}") is not None]
        keep = set(complete[: self.keep_last]) | {current}
        for n in names:
            if n in keep or step_of(n) >= cur_step:
                continue
            # Manifest first: a half-deleted checkpoint must look incomplete, never complete.
            self.storage.delete_prefix(f"{n}/{MANIFEST}")
            self.storage.delete_prefix(f"{n}/")

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
        import torch.distributed.checkpoint as dcp

        err = None
        try:
            writer = dcp.FileSystemWriter(
                str(stage), single_file_per_rank=True, sync_files=True, thread_count=1
            )
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                dcp.save(app_state, storage_writer=writer, process_group=group)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises on every rank
            full = self._disk_full(exc, stage)
            shutil.rmtree(stage, ignore_errors=True)
            raise CheckpointError(
                f"checkpoint {name} not saved: {full or f'DCP save failed ({one_line(exc)})'}"
            ) from exc
        try:
            if rank_state is not None:
                _save_rank_state(rank_state, stage / _rank_file(self.rank))
            self._stage_files(stage, files)
        except Exception as exc:  # noqa: BLE001
            err = self._disk_full(exc, stage) or f"cannot write rank_state ({one_line(exc, 160)})"
        per_rank = err if err else self._upload_stage(name, stage)
        return self._commit(step, name, stage, "dcp", per_rank, meta, group)

    def _disk_full(self, exc: BaseException, stage: Path) -> str:
        """The one line for a staged write that ran out of disk (ENOSPC, EDQUOT: also inside
        DCP's per-rank failures, or torch's "unexpected pos" of a short write), else ''."""
        if not _out_of_space(exc, stage):
            return ""
        if isinstance(self.storage, LocalStorage):
            fix = "set checkpoint.root to a disk with room (its .staging holds each save)"
        else:
            fix = "set GPN_CKPT_STAGING to a local disk with room"
        return (
            f"no space left on device writing the checkpoint into the staging directory "
            f"{self._staging_root}; free space there (old checkpoints, caches) or {fix}"
        )

    def _stage_files(self, stage: Path, files: dict[str, bytes] | None) -> None:
        if self.rank != 0 or not files:
            return
        for rel, content in files.items():
            if "/" in rel or rel.startswith(".") or _rank_file(0)[:5] in rel:
                raise CheckpointError(f"extra checkpoint file {rel!r}: give a plain file name")
            (stage / rel).write_bytes(content)

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
        err = None
        try:
            # Each rank saves into its own staging root, so the files it staged are exactly the
            # files it wrote (no guessing from DeepSpeed's file names).
            ok = engine.save_checkpoint(
                str(stage.parent), tag=name, client_state={}, save_latest=False
            )
            if ok is False:
                err = "engine.save_checkpoint returned False"
        except Exception as exc:  # noqa: BLE001
            err = self._disk_full(exc, stage) or (
                f"DeepSpeed save_checkpoint failed ({one_line(exc, 200)})"
            )
        try:
            if not err and rank_state is not None:
                _save_rank_state(rank_state, stage / _rank_file(self.rank))
            if not err:
                self._stage_files(stage, files)
        except Exception as exc:  # noqa: BLE001
            err = self._disk_full(exc, stage) or f"cannot write rank_state ({one_line(exc, 160)})"
        per_rank = err if err else self._upload_stage(name, stage)
        return self._commit(step, name, stage, "deepspeed", per_rank, meta)

    # -- loading ------------------------------------------------------------------------------

    def _materialise(self, uri: str, kind: str) -> tuple[dict[str, Any], Storage, str, Path, bool]:
        """Collective: verified manifest + a local directory holding the checkpoint's files.

        Returns (manifest, storage, name, local_dir, downloaded). Every file is hashed once:
        local roots split the hashing across ranks; S3 downloads are hashed by the downloader.
        Damage (check_step's reasons, a sha256 mismatch) raises CheckpointDamaged on every rank.
        """
        storage, name = self._locate(uri)
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
                    f"it is a {manifest.get('kind')} checkpoint; load it with the matching "
                    "load method"
                )
            else:
                local, err = self._verified_files(storage, name, manifest["files"], local)
                damaged = err is not None
        except CheckpointError as exc:
            err = str(exc)
        except Exception as exc:  # noqa: BLE001 - must reach the gather, or the other ranks hang
            err = one_line(exc, 200)
        full_uri = storage.child_uri(name)
        results = self._gather((err, damaged, full_uri))
        if downloaded and local is not None and any(e for e, _, _ in results):
            shutil.rmtree(local.parent, ignore_errors=True)  # this load's own download folder
        for r, (rank_err, bad, _) in enumerate(results):
            if rank_err:
                where = f" (rank {r})" if self.world_size > 1 else ""
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
        return manifest, storage, name, local, downloaded

    def _verified_files(
        self, storage: Storage, name: str, files: dict[str, Any], local: Path | None
    ) -> tuple[Path, str | None]:
        """(the local directory holding the checkpoint's files, the first damage found or
        None): an S3 checkpoint's files downloaded (kept when already there and matching) and
        hashed; a local root's files hashed where they are, split across the ranks."""
        if local is None:
            local = self._download_dir() / name
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
        for i, (rel, entry) in enumerate(sorted(files.items())):
            if i % self.world_size == self.rank and sha256_file(local / rel) != entry["sha256"]:
                return local, f"file {rel} does not match its sha256 in the manifest"
        return local, None

    def _loaded(
        self, manifest: dict[str, Any], local: Path, uri: str, kind: str
    ) -> LoadedCheckpoint:
        """Collective: this rank's rank_state (when the world size matches) + the rest."""
        saved_world = int(manifest.get("world_size", 1))
        rank_state, err, damaged = None, None, False
        try:
            if saved_world == self.world_size and _rank_file(self.rank) in manifest["files"]:
                rank_state = safe_torch_load(local / _rank_file(self.rank))
        except CheckpointError as exc:
            err, damaged = str(exc), isinstance(exc, CheckpointDamaged)
        self._agree(err, f"cannot load {uri}", damaged)
        return LoadedCheckpoint(
            meta=manifest.get("meta", {}),
            rank_state=rank_state,
            step=int(manifest["step"]),
            uri=uri,
            world_size=saved_world,
            kind=kind,
        )

    def load(self, uri: str, app_state: dict[str, Any]) -> LoadedCheckpoint:
        """COLLECTIVE when distributed. dcp.load into `app_state` in place (tensors and python
        values; the caller then applies it, e.g. with set_state_dict). Works on a different world
        size (DCP reshards); rank_state is then None."""
        import torch.distributed.checkpoint as dcp

        manifest, storage, name, local, downloaded = self._materialise(uri, "dcp")
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
        try:
            return self._loaded(manifest, local, full_uri, "dcp")
        finally:
            if downloaded:
                shutil.rmtree(local.parent, ignore_errors=True)

    def load_deepspeed(self, uri: str, engine: Any) -> LoadedCheckpoint:
        """COLLECTIVE. engine.load_checkpoint from the verified files (same world size only:
        DeepSpeed ZeRO shards cannot be re-split without converting to its universal format).
        Every file DeepSpeed reads is loaded with weights_only=True."""
        manifest, storage, name, local, downloaded = self._materialise(uri, "deepspeed")
        full_uri = storage.child_uri(name)
        if int(manifest.get("world_size", 1)) != self.world_size:
            raise CheckpointError(
                f"cannot load {full_uri}: DeepSpeed checkpoint saved on "
                f"{manifest.get('world_size')} ranks, now "
                f"{self.world_size}; resume on the same number of ranks or convert it with "
                "ds_to_universal"
            )
        ckpt_engine = engine.checkpoint_engine
        original = ckpt_engine.load
        ckpt_engine.load = lambda path, map_location=None, **_: _deepspeed_safe_load(path)
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
            raise CheckpointError(
                f"cannot load {full_uri}: DeepSpeed found no checkpoint in {local}"
            )
        try:
            loaded = self._loaded(manifest, local, full_uri, "deepspeed")
            loaded.extra["client_state"] = client_state
            return loaded
        finally:
            if downloaded:
                shutil.rmtree(local.parent, ignore_errors=True)


def _save_rank_state(state: dict[str, Any], path: Path) -> None:
    """torch.save through a Python file: a full disk is then an OSError (ENOSPC), not the
    "unexpected pos 10048 vs 9936" of torch's own file writer."""
    with open(path, "wb") as f:
        torch.save(state, f)


_SHORT_WRITE = ("unexpected pos", "file write failed", "no space left on device")


def _out_of_space(exc: BaseException, stage: Path) -> bool:
    """Whether `exc` (its chain, DCP's per-rank failures) is a write that found no room."""
    stack: list[Any] = [exc]
    seen, short_write = 0, False
    while stack and seen < 50:
        e = stack.pop()
        seen += 1
        if isinstance(e, tuple):  # DCP keeps (exception, traceback) pairs
            stack.extend(x for x in e if isinstance(x, BaseException))
            continue
        if not isinstance(e, BaseException):
            continue
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        short_write = short_write or any(w in str(e).lower() for w in _SHORT_WRITE)
        stack.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack.extend(failures.values())
    if not short_write:
        return False
    # torch's own writer lost the errno: ask the disk whether a small write still fits.
    try:
        free = shutil.disk_usage(stage if stage.exists() else stage.parent).free
    except OSError:
        return False
    return free < 16 * 1024 * 1024


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


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _deepspeed_safe_load(path: str) -> Any:
    from gpn_scale.checkpoint.safe_load import deepspeed_safe_globals

    return safe_torch_load(Path(path), extra_safe_globals=deepspeed_safe_globals())


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
