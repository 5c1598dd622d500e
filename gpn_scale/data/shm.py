"""Clean up what a killed streaming job leaves behind.

StreamingDataset registers `/dev/shm/NNNNNN_*` segments (NNNNNN = a prefix number) and
filelocks `NNNNNN_*_filelock` in `tempfile.gettempdir()`. A process killed with SIGKILL
(preemption, OOM, `scancel`) never unlinks them. The next run that uses the same local
cache directory but another temp directory then fails with "Reused local directory".

streaming's own `clean_stale_shared_memory()` is not usable here: it unlinks segments
whether or not a live job still uses them, and stops at the first free prefix. So this is
hand-written: a prefix is stale when no live process maps any of its segments (read from
/proc/*/maps, Linux only); stale segments and their filelocks are removed.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_SEGMENT = re.compile(r"^(\d{6})_[a-z_]+$")
_MAPPED = re.compile(r"/dev/shm/(\d{6})_[a-z_]+")
# A segment younger than this may belong to a job between creating and mapping it.
MIN_AGE_S = 2.0


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
        in_use.update(_MAPPED.findall(maps))
    return in_use


def clean_stale_streaming_shm(tmp_dir: str | None = None) -> list[str]:
    """Remove streaming segments and filelocks that no live process uses.

    Safe to call while other streaming jobs run on the same machine: their segments are
    mapped, so they are kept. Returns the names removed.
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
    for entry in SHM_DIR.iterdir():
        match = _SEGMENT.match(entry.name)
        if not match or match.group(1) in in_use:
            continue
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        if st.st_uid != uid or now - st.st_mtime < MIN_AGE_S:
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
                if now - entry.stat().st_mtime < MIN_AGE_S:
                    continue
                entry.unlink()
                removed.append(str(entry))
            except (FileNotFoundError, PermissionError):
                continue
    return removed
