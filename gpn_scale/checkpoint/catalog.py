"""Which checkpoints a root holds and whether each is complete: the storage side of the
layout (manager.py's docstring), without torch.

slurm/train.sbatch asks for the newest checkpoint's step before and after every run
(`gpn-scale train ... --latest-step`): answered from here, that is one Python start without
torch's import (~3-4 CPU-seconds a call on a batch node). CheckpointManager finds, lists and
resumes through the same functions."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from gpn_scale.checkpoint.errors import one_line
from gpn_scale.io.storage import ObjectInfo, Storage

FORMAT = "gpn_scale.checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
STEP_DIR_RE = re.compile(r"^step_(\d{9,})$")


def step_dir_name(step: int) -> str:
    """`step_000000200`: zero-padded so lexical and numeric order agree."""
    return f"step_{int(step):09d}"


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_step(
    storage: Storage, name: str, *, deep: bool = False
) -> tuple[dict[str, Any] | None, str]:
    """(manifest, "") when step folder `name` is complete and its files match, else (None,
    reason).

    Cheap by default: one listing; sizes must match; a local file whose mtime changed, or an
    S3 object whose ETag changed since the manifest was written, is re-hashed (local) or
    rejected (S3). deep=True re-hashes every local file.
    """
    raw = storage.get_bytes(f"{name}/{MANIFEST}")
    if raw is None:
        if not storage.list(f"{name}/"):
            return None, "no such step folder (it is missing: deleted, or never written)"
        return None, "no manifest.json (the save did not finish)"
    try:
        manifest = json.loads(raw)
        files: dict[str, dict[str, Any]] = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            return (
                None,
                f"manifest.json has format {manifest.get('format')!r}, expected {FORMAT!r}",
            )
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"manifest.json is unreadable ({one_line(exc, 120)})"
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


def step_of(name: str) -> int:
    return int(name[len("step_") :])


def step_dirs(storage: Storage) -> list[str]:
    """The step folders under the root, newest first (complete or not)."""
    return sorted(
        (n for n in storage.list_dirs() if STEP_DIR_RE.match(n)), key=step_of, reverse=True
    )


def find_latest(storage: Storage) -> tuple[str | None, list[tuple[str, str]]]:
    """(URI of the newest complete checkpoint or None, skipped): the `latest` pointer if it
    verifies, else the highest complete step folder. `skipped` is [(uri, reason)] for the step
    folders newer than the one returned that are not complete (damaged, or a save that did
    not finish), newest first."""
    skipped: list[tuple[str, str]] = []
    tried: dict[str, str] = {}
    raw = storage.get_bytes(LATEST)
    candidates = step_dirs(storage)
    if raw is not None:
        try:
            name = str(json.loads(raw)["name"])
        except (ValueError, KeyError, TypeError):
            name = ""
        if STEP_DIR_RE.match(name):
            reason = check_step(storage, name)[1]
            if not reason:
                for newer in (n for n in candidates if step_of(n) > step_of(name)):
                    why = check_step(storage, newer)[1]
                    if why:
                        skipped.append((storage.child_uri(newer), why))
                return storage.child_uri(name), skipped
            tried[name] = reason
    for name in candidates:
        reason = tried[name] if name in tried else check_step(storage, name)[1]
        if not reason:
            return storage.child_uri(name), skipped
        skipped.append((storage.child_uri(name), reason))
    return None, skipped
