"""Which checkpoints a root holds and whether each is complete: the storage side of the
layout (manager.py's docstring), without torch.

slurm/train.sbatch asks for the newest checkpoint's step before and after every run
(`gpn-scale train ... --latest-step`): answered from here, that is one Python start without
torch's import (~3-4 CPU-seconds a call on a batch node). CheckpointManager finds, lists and
resumes through the same functions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from gpn_scale.checkpoint.errors import one_line
from gpn_scale.io import run_folder
from gpn_scale.io.run_folder import LATEST, MANIFEST, STEP_DIR_RE
from gpn_scale.io.storage import ObjectInfo, Storage

FORMAT = "gpn_scale.checkpoint/1"


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_step(
    storage: Storage, name: str, *, deep: bool = False
) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") when step folder `name` is complete and its files match, else (None,
    reason).

    Cheap by default: one listing; the manifest's step (and its meta's) must be the folder's;
    sizes must match; a local file whose mtime changed, or an S3 object whose ETag changed
    since the manifest was written, is re-hashed (local) or rejected (S3). deep=True
    re-hashes every local file.
    """
    raw = storage.get_bytes(f"{name}/{MANIFEST}")
    if raw is None:
        if not storage.list(f"{name}/"):
            return None, "no such step folder (it is missing: deleted, or never written)"
        return None, "no manifest.json (the save did not finish)"
    manifest, reason = _parse_manifest(raw)
    if manifest is None:
        return None, reason
    # A manifest in a folder of another step (renamed, or copied over) would resume at its
    # own step under the folder's name: steps skipped or repeated in silence.
    meta = manifest.get("meta")
    for what, said in (
        (MANIFEST, manifest.get("step")),
        (f"{MANIFEST}'s meta", meta.get("step") if isinstance(meta, dict) else None),
    ):
        if said is not None and _as_int(said) != step_of(name):
            return None, (
                f"{what} says step {said}, but its folder is {name} (a renamed or copied folder?)"
            )
    files: dict[str, dict[str, Any]] = manifest["files"]
    listing = storage.list(f"{name}/")
    local = storage.local_dir(name)
    for rel, want in files.items():
        have: ObjectInfo | None = listing.get(f"{name}/{rel}")
        if have is None:
            return None, f"file {rel} is missing"
        if have.size != want["size"]:
            return None, f"file {rel} has {have.size} bytes, manifest says {want['size']}"
        if have.etag is not None and want.get("etag") and have.etag != want["etag"]:
            return None, f"file {rel} was rewritten after the manifest (ETag changed)"
        if local is not None and (
            deep or (want.get("mtime_ns") is not None and have.mtime_ns != want["mtime_ns"])
        ):
            if sha256_file(local / rel) != want["sha256"]:
                return None, f"file {rel} does not match its sha256 in the manifest"
    return manifest, ""


def _parse_manifest(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") when it is one of ours with a size and sha256 for each file, else
    (None, reason)."""
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            return (
                None,
                f"manifest.json has format {manifest.get('format')!r}, expected {FORMAT!r}",
            )
        for rel, want in files.items():
            if not isinstance(want.get("size"), int) or not isinstance(want.get("sha256"), str):
                return None, f"manifest.json is unreadable (no size or sha256 for {rel})"
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"manifest.json is unreadable ({one_line(exc, 120)})"
    return manifest, ""


def _as_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def step_of(name: str) -> int:
    """The step of a step folder's name (one that STEP_DIR_RE matches)."""
    step = run_folder.step_of(name)
    if step is None:
        raise ValueError(f"not a step folder name: {name!r}")
    return step


def step_dirs(storage: Storage) -> list[str]:
    """The step folders under the root, newest first (complete or not)."""
    return sorted(
        (n for n in storage.list_dirs() if STEP_DIR_RE.match(n)), key=step_of, reverse=True
    )


def find_latest(
    storage: Storage, exclude: dict[str, str] | None = None
) -> tuple[str | None, list[tuple[str, str]], str]:
    """(URI of the newest complete checkpoint or None, skipped, note).

    The newest is the `latest` pointer's folder when it verifies and no complete folder of a
    higher step was written after it, else the highest complete step folder. A run resumed
    from an older checkpoint re-saves lower steps after higher ones, and its pointer names
    them; a pointer whose update was lost (a crash between a manifest and the pointer, a
    folder copied in) is stale, and the folder written after it wins: `note` says so ("" else).

    `skipped` is [(uri, reason)] for the step folders newer than the one returned that are
    not complete (damaged, or a save that did not finish), newest first. `exclude`: {name:
    reason} for folders found damaged otherwise (a load that failed): never returned."""
    seen: dict[str, tuple[dict[str, Any] | None, str]] = {}

    def check(name: str) -> tuple[dict[str, Any] | None, str]:
        if name not in seen:
            known = (exclude or {}).get(name)
            seen[name] = (None, known) if known else check_step(storage, name)
        return seen[name]

    candidates = step_dirs(storage)
    chosen, note = None, ""
    pointer = _pointer(storage)
    target = check(pointer)[0] if pointer else None
    if target is not None:
        chosen = pointer
        for newer in (n for n in candidates if step_of(n) > step_of(pointer)):
            manifest = check(newer)[0]
            if manifest is not None and _written(manifest) > _written(target):
                chosen = newer
                note = (
                    f"the `latest` pointer names {storage.child_uri(pointer)}, but "
                    f"{storage.child_uri(newer)} is complete and was written after it; taking "
                    f"{newer} (the pointer is stale)"
                )
                break
    if chosen is None:
        chosen = next((n for n in candidates if check(n)[0] is not None), None)
    skipped = [
        (storage.child_uri(n), check(n)[1])
        for n in candidates
        if (chosen is None or step_of(n) > step_of(chosen)) and check(n)[0] is None
    ]
    return (storage.child_uri(chosen) if chosen else None), skipped, note


def _pointer(storage: Storage) -> str:
    """The step folder the `latest` pointer names ("" when there is none or it is garbage)."""
    raw = storage.get_bytes(LATEST)
    try:
        name = str(json.loads(raw)["name"]) if raw is not None else ""
    except (ValueError, KeyError, TypeError):
        name = ""
    return name if STEP_DIR_RE.match(name) else ""


def _written(manifest: dict[str, Any]) -> float:
    """When the save finished (the manifest's clock; 0 when it does not say)."""
    try:
        return float(manifest.get("created_unix") or 0.0)
    except (TypeError, ValueError):
        return 0.0
