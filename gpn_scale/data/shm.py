"""Clean up what a killed streaming job leaves behind.

StreamingDataset registers `/dev/shm/NNNNNN_*` segments (NNNNNN = a prefix number) and
filelocks `NNNNNN_*_filelock` in `tempfile.gettempdir()`. A process killed with SIGKILL
(preemption, OOM, `scancel`) never unlinks them. The next run that uses the same local
cache directory but another temp directory then fails with "Reused local directory".

streaming's own `clean_stale_shared_memory()` is not usable here: it unlinks segments
whether or not a live job still uses them, and stops at the first free prefix. So this is
hand-written: a prefix is stale when no live process maps any of its segments (read from
/proc/*/maps, Linux only) and either its segments are older than `MIN_AGE_S` or its
`_locals` segment registers one of *our* cache directories (then it is certainly a dead
run of ours, and waiting would only make the restart fail). Stale segments and their
filelocks are removed.

It also serialises streaming's prefix registration among the jobs of one machine
(`registration_lock`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_SEGMENT = re.compile(r"^(\d{6})_[a-z_]+$")
_MAPPED = re.compile(r"/dev/shm/(\d{6})_([a-z_]+)")
# Segments of other jobs younger than this are left alone: a job may be between creating
# and mapping them, and a just-killed job's owner may want to look at them.
MIN_AGE_S = 30.0


# One lock file per machine (in /dev/shm, like the segments it guards; every job of every
# user sees the same one, whatever its TMPDIR).
REGISTRATION_LOCK = "gpn_scale_streaming_registration.lock"


@contextlib.contextmanager
def registration_lock() -> Iterator[None]:
    """Hold while a StreamingDataset is constructed (by each job's local leader only).

    streaming picks the first prefix whose `_locals` segment does not exist yet and then
    creates that segment: check-then-create with no lock between jobs, so two jobs that start
    together on one node (SLURM array tasks do) can pick the same prefix, and the second
    fails with FileExistsError. Taken by local leaders only: a job's other ranks wait for
    their leader at streaming's own barrier, never for another job's lock. A lock file that
    cannot be opened (another user's, unreadable) leaves the construction unserialised.
    """
    directory = SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())
    try:
        # Read-only is enough for flock, so a lock file created by another user still works.
        fd = os.open(directory / REGISTRATION_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)    # releases the lock


def _prefixes_in_use() -> set[str] | None:
    """Prefixes mapped by any live process; None if /proc cannot be read (not Linux)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    in_use: set[str] = set()
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            maps = (pid_dir / "maps").read_text(errors="replace")
        except (PermissionError, ProcessLookupError):
            # A process we cannot inspect could own a segment we cannot tell apart; its
            # segments are then owned by another user and not ours to remove anyway.
            continue
        except (FileNotFoundError, OSError):
            continue
        # Every streaming process that picks a prefix walks the existing ones and maps their
        # `_locals` segment, and may keep it mapped: a `_locals` mapping alone says nothing
        # about ownership. The owner of a prefix maps its other segments (barrier, states).
        in_use.update(prefix for prefix, kind in _MAPPED.findall(maps) if kind != "locals")
    return in_use


def _registered_locals(prefix: str) -> list[str]:
    """Cache directories a streaming `_locals` segment registers (its format: int32 size,
    then the directories and the prefix joined by NUL)."""
    try:
        data = (SHM_DIR / f"{prefix}_locals").read_bytes()
        size = int.from_bytes(data[:4], "little", signed=True)
        return data[4:size].decode("utf-8", errors="replace").split("\0")[:-1]
    except (OSError, ValueError):
        return []


def clean_stale_streaming_shm(tmp_dir: str | None = None, *,
                              our_locals: list[str] | None = None,
                              min_age_s: float = MIN_AGE_S) -> list[str]:
    """Remove streaming segments and filelocks that no live process uses.

    Safe to call while other streaming jobs run on the same machine: their segments are
    mapped, so they are kept. `our_locals`: the caller's cache directories; unmapped
    prefixes registering one of them are removed whatever their age. Returns the names
    removed.
    """
    if not SHM_DIR.is_dir():
        return []
    in_use = _prefixes_in_use()
    if in_use is None:
        return []
    uid = os.getuid()
    now = time.time()
    removed: list[str] = []
    stale_prefixes: set[str] = set()
    ours = {os.path.abspath(p) for p in our_locals or []}
    for entry in sorted(SHM_DIR.iterdir()):
        match = _SEGMENT.match(entry.name)
        if not match or match.group(1) in in_use:
            continue
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        if st.st_uid != uid:
            continue
        prefix = match.group(1)
        mine = prefix in stale_prefixes or bool(ours.intersection(_registered_locals(prefix)))
        if not mine and now - st.st_mtime < min_age_s:
            continue
        try:
            entry.unlink()
            removed.append(entry.name)
            stale_prefixes.add(match.group(1))
        except (FileNotFoundError, PermissionError):
            continue
    # Filelocks of stale prefixes; and lock files whose prefix has no segment at all
    # (a job killed after its segments were cleaned) — both only cost prefix numbers, but
    # they accumulate forever.
    lock_dir = Path(tmp_dir or tempfile.gettempdir())
    live_segments = {m.group(1) for e in SHM_DIR.iterdir() if (m := _SEGMENT.match(e.name))}
    if lock_dir.is_dir():
        for entry in lock_dir.iterdir():
            if not entry.name.endswith("_filelock"):
                continue
            prefix = entry.name[:6]
            if not prefix.isdigit() or prefix in in_use or prefix in live_segments:
                continue
            try:
                if now - entry.stat().st_mtime < min_age_s:
                    continue
                entry.unlink()
                removed.append(str(entry))
            except (FileNotFoundError, PermissionError):
                continue
    return removed
