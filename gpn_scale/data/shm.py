"""Clean up what a killed streaming job leaves behind.

StreamingDataset registers `/dev/shm/NNNNNN_*` segments (NNNNNN = a prefix number) and
filelocks `NNNNNN_*_filelock` in `tempfile.gettempdir()`. A process killed with SIGKILL
(preemption, OOM, `scancel`) never unlinks them. The next run that uses the same local
cache directory but another temp directory then fails with "Reused local directory".

streaming's own `clean_stale_shared_memory()` is not usable here: it unlinks segments
whether or not a live job still uses them, and stops at the first free prefix. So this is
hand-written. Every prefix our loaders register gets an owner record
(`/dev/shm/gpn_scale_owner_NNNNNN`: the registering process's PID, its start time and PID
namespace). A prefix whose recorded owner is gone is stale at once, whatever its age and
whoever maps it: streaming's prefix scan maps the segments of every prefix it walks past
(and keeps them mapped), so a restarted job maps its dead predecessor's segments itself,
and "mapped by a live process" alone cannot tell a dead run from a live one. Prefixes
without a record (another tool's streaming job, or one killed while registering) are stale
when no other live process maps any of their segments (read from /proc/*/maps, Linux only)
and either their segments are older than `MIN_AGE_S` or their `_locals` segment registers
one of *our* cache directories. Stale segments, their filelocks and records are removed.

It also serialises streaming's prefix registration among the jobs of one machine
(`registration_lock`), and keeps streaming's segments out of Python's resource tracker
(`untrack_streaming_segments`): the cleaner is then the only one that removes a dead job's.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator, Sized
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_SEGMENT = re.compile(r"^(\d{6})_[a-z_]+$")
_MAPPED = re.compile(r"/dev/shm/(\d{6})_([a-z_]+)")
# Segments of other jobs younger than this are left alone: a job may be between creating
# and mapping them, and a just-killed job's owner may want to look at them.
MIN_AGE_S = 30.0


# ---------------------------------------------------------------------------------------------
# Python's resource tracker.
#
# Python (3.11, 3.12) registers every shared-memory segment a process creates with that
# process's resource tracker, a helper process that unlinks, by name, whatever is still
# registered when the process dies. After a SIGKILL that happens a moment later, or much later
# when a child (a DataLoader worker) still holds the tracker's pipe. Meanwhile the cleaner
# below may have removed the dead job's segments and a new loader registered the same prefix
# number: the tracker then unlinks the new loader's live segments. The next loader takes that
# number again, and the two share every segment streaming opens by name: one reads the
# other's resume state (seen in the suite as a held-out loss of other windows; reproduced
# with the tracker paused across the kill). So streaming's segments are not tracked: a dead
# job's stay until the cleaner, which knows their owner and holds the machine's lock, removes
# them (as after a kill of the whole process group, which takes the tracker with it).
_STREAMING_NAME = re.compile(r"^/?\d{6}_[a-z_]+$")
_UNTRACK_LOCK = threading.Lock()
_UNTRACKED: set[str] = set()  # streaming segments this process made and did not register


def untrack_streaming_segments() -> None:
    """Keep the streaming segments (`NNNNNN_*`) this process makes from now on out of its
    resource tracker (see above); every other registration goes through, and so does the
    unregistration of a segment registered before. Once per process, before the first
    segment is made (a forked DataLoader worker inherits it). Python 3.13's
    `SharedMemory(track=False)` says the same per segment; streaming does not pass it."""
    from multiprocessing import resource_tracker

    with _UNTRACK_LOCK:
        if getattr(resource_tracker.register, "_gpn_untracked", False):
            return
        register, unregister = resource_tracker.register, resource_tracker.unregister

        # (typeshed's name is `Sized`: the tracker takes any name its cleanup function does)
        def register_unless_streaming(name: Sized, rtype: str) -> None:
            if rtype == "shared_memory" and isinstance(name, str) and _STREAMING_NAME.match(name):
                _UNTRACKED.add(name)
                return
            register(name, rtype)

        def unregister_if_registered(name: Sized, rtype: str) -> None:
            if rtype == "shared_memory" and name in _UNTRACKED:
                _UNTRACKED.discard(name)
                return
            unregister(name, rtype)

        register_unless_streaming._gpn_untracked = True  # type: ignore[attr-defined]
        resource_tracker.register = register_unless_streaming
        resource_tracker.unregister = unregister_if_registered


# Owner records, one per prefix registered by our loaders (beside the segments; the name
# does not match _SEGMENT, so streaming and the cleaner's segment walk ignore it).
OWNER_RECORD = "gpn_scale_owner_"
# Prefixes registered by this process, with their `_locals` segment's identity: alive by
# definition while that segment is the one registered (a prefix number this process freed may
# be taken by another job since, which can die and leave it stale).
_OWN_PREFIXES: dict[str, list[int] | None] = {}


def _own_prefixes() -> set[str]:
    return {p for p, ident in _OWN_PREFIXES.items() if _locals_identity(p) == ident}


def _process_identity(pid: int) -> tuple[str, str] | None:
    """(start time in clock ticks since boot, PID namespace) of a live process, else None.
    The start time tells a reused PID from the original process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # Field 22 (starttime); split after the command name, which may hold spaces.
        start = stat.rsplit(")", 1)[1].split()[19]
        ns = os.readlink(f"/proc/{pid}/ns/pid")
    except (OSError, IndexError):
        return None
    return start, ns


def record_owner(prefix_int: int) -> None:
    """Write the owner record of a prefix this process just registered (best effort: without
    it the prefix is judged by maps and age, as before)."""
    prefix = f"{int(prefix_int):06d}"
    _OWN_PREFIXES[prefix] = _locals_identity(prefix)
    ident = _process_identity(os.getpid())
    if ident is None or not SHM_DIR.is_dir():
        return
    path = SHM_DIR / f"{OWNER_RECORD}{prefix}"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        record = {
            "pid": os.getpid(),
            "start": ident[0],
            "pidns": ident[1],
            "locals": _locals_identity(prefix),
        }
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return
    atexit.register(_drop_record, path, record)


def _drop_record(path: Path, record: dict) -> None:
    """At a normal exit (streaming unlinks the segments then): remove our record, if it is
    still ours, so that no record outlives its registration."""
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()) == record:
            path.unlink()


def _locals_identity(prefix: str) -> list[int] | None:
    """(inode, ctime_ns) of a prefix's `_locals` segment: ties a record to one registration
    (a later job reusing the prefix number creates a new segment)."""
    try:
        st = (SHM_DIR / f"{prefix}_locals").stat()
    except OSError:
        return None
    return [st.st_ino, st.st_ctime_ns]


def _owner_alive(prefix: str) -> bool | None:
    """True / False when the prefix's owner record says its process lives / is gone; None
    when there is no readable record, or it was written in another PID namespace (a
    container sharing /dev/shm: its PIDs mean nothing here)."""
    if prefix in _own_prefixes():
        return True
    try:
        record = json.loads((SHM_DIR / f"{OWNER_RECORD}{prefix}").read_text())
        pid, start, pidns = int(record["pid"]), str(record["start"]), str(record["pidns"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    current = _locals_identity(prefix)
    if current is not None and current != record.get("locals"):
        return None  # the prefix number was registered again since: the record is not about it
    mine = _process_identity(os.getpid())
    if mine is None or mine[1] != pidns:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    ident = _process_identity(pid)
    if ident is None:  # exited just now, or not ours to inspect: only a reuse check is lost
        return os.path.exists(f"/proc/{pid}")
    return ident[0] == start  # another start time: the PID was reused by a new process


# One lock file per machine (in /dev/shm, like the segments it guards; every job of every
# user sees the same one, whatever its TMPDIR).
REGISTRATION_LOCK = "gpn_scale_streaming_registration.lock"


@contextlib.contextmanager
def registration_lock(local_leader: bool = True, lock_dir: Path | None = None) -> Iterator[None]:
    """Hold while a StreamingDataset is constructed; every rank of the job enters it.

    streaming picks the first prefix whose `_locals` segment does not exist yet and then
    creates that segment: check-then-create with no lock between jobs, so two jobs that start
    together on one node (SLURM array tasks do) can pick the same prefix, and the second
    fails with FileExistsError. Each job's local leader holds its node's lock file; the
    other ranks hold nothing (they wait for their leader at streaming's own barrier).

    The construction runs job-wide barriers while the locks are held, so a multi-node job
    holds one lock per node at once. Two such jobs on the same nodes, each taking its locks
    one node at a time, can each get one node's lock and wait forever for the other's (job
    A holds node 0 and waits at the barrier for its rank on node 1, which waits for node 1's
    lock held by job B, which waits for node 0). So with torch.distributed initialised the
    job takes all its locks or none: every leader tries its own without blocking, the job
    compares (all_gather_object, any backend), and unless every leader got its lock the
    ones that did release it and all back off for a random moment before trying again.

    A lock file that cannot be opened (another user's, unreadable) leaves that node's
    construction unserialised. `lock_dir`: where the lock file lives (default /dev/shm,
    where the segments are; tests give each simulated node its own)."""
    import random

    import torch.distributed as dist

    directory = lock_dir or (SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir()))
    fd = None
    if local_leader:
        try:
            # Read-only is enough for flock, so a lock file created by another user works.
            fd = os.open(directory / REGISTRATION_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError:
            fd = None
    collective = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    try:
        if not collective:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            rng = random.Random(os.getpid() ^ time.monotonic_ns())
            for attempt in range(1_000_000):
                got = True
                if fd is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        got = False
                votes: list[object] = [None] * dist.get_world_size()
                dist.all_gather_object(votes, got)
                if all(votes):
                    break
                if got and fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                # Randomised back-off (up to ~1 s): two jobs that collided try again apart.
                time.sleep(rng.uniform(0.01, 0.05) * min(2**attempt, 20))
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _prefixes_in_use() -> set[str] | None:
    """Prefixes mapped by any live process; None if /proc cannot be read (not Linux)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    in_use: set[str] = _own_prefixes()
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


def clean_stale_streaming_shm(
    tmp_dir: str | None = None, *, our_locals: list[str] | None = None, min_age_s: float = MIN_AGE_S
) -> list[str]:
    """Remove streaming segments and filelocks that no live process uses.

    Safe to call while other streaming jobs run on the same machine: their segments are
    mapped (or their owner record names a live process), so they are kept. A prefix whose
    owner record names a dead process is removed at once. `our_locals`: the caller's cache
    directories; unmapped prefixes registering one of them are removed whatever their age.
    Returns the names removed.

    It holds the machine's registration lock file (`registration_lock`) while it judges and
    removes: a job registering meanwhile could take a prefix number that a dead job's record
    still names (streaming takes the first number without a `_locals` segment), and lose its
    fresh segments to a judgement made before they existed. (Seen in the full suite: one
    xdist worker's loader cleaned another's just-registered prefix; that job's second rank
    then found no `/000000_locals`.) Never call it inside `registration_lock`.
    """
    if not SHM_DIR.is_dir():
        return []
    with _machine_lock():
        return _clean(tmp_dir, our_locals, min_age_s)


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    """The registration lock file held (blocking) by this process alone; unlocked where it
    cannot be opened (another user's, unreadable), as `registration_lock` does."""
    try:
        fd = os.open(SHM_DIR / REGISTRATION_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _clean(tmp_dir: str | None, our_locals: list[str] | None, min_age_s: float) -> list[str]:
    in_use = _prefixes_in_use()
    if in_use is None:
        return []
    uid = os.getuid()
    now = time.time()
    removed: list[str] = []
    stale_prefixes: set[str] = set()
    ours = {os.path.abspath(p) for p in our_locals or []}
    alive = _owners()
    dead = {prefix for prefix, live in alive.items() if live is False}  # recorded owner gone
    for entry in sorted(SHM_DIR.iterdir()):
        match = _SEGMENT.match(entry.name)
        if not match:
            continue
        prefix = match.group(1)
        owner = alive.get(prefix)
        if owner is True or (owner is None and prefix in in_use):
            continue
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        if st.st_uid != uid:
            continue
        mine = (
            owner is False
            or prefix in stale_prefixes
            or bool(ours.intersection(_registered_locals(prefix)))
        )
        if not mine and now - st.st_mtime < min_age_s:
            continue
        try:
            entry.unlink()
            removed.append(entry.name)
            stale_prefixes.add(match.group(1))
        except (FileNotFoundError, PermissionError):
            continue
    removed += _remove_stale_locks(tmp_dir, alive, dead, in_use, now, min_age_s)
    for prefix in dead:  # after the segments and locks it vouched for
        with contextlib.suppress(OSError):
            (SHM_DIR / f"{OWNER_RECORD}{prefix}").unlink()
            removed.append(f"{OWNER_RECORD}{prefix}")
    return removed


def _owners() -> dict[str, bool | None]:
    """{prefix: whether the process its owner record names is alive (None: unknown)}."""
    alive: dict[str, bool | None] = {}
    for entry in SHM_DIR.iterdir():
        if entry.name.startswith(OWNER_RECORD):
            prefix = entry.name[len(OWNER_RECORD) :]
            alive[prefix] = _owner_alive(prefix)
    return alive


def _remove_stale_locks(
    tmp_dir: str | None,
    alive: dict[str, bool | None],
    dead: set[str],
    in_use: set[str],
    now: float,
    min_age_s: float,
) -> list[str]:
    """Filelocks of stale prefixes; and lock files whose prefix has no segment at all (a job
    killed after its segments were cleaned) — both only cost prefix numbers, but they
    accumulate forever. Returns the paths removed."""
    removed: list[str] = []
    lock_dir = Path(tmp_dir or tempfile.gettempdir())
    live_segments = {m.group(1) for e in SHM_DIR.iterdir() if (m := _SEGMENT.match(e.name))}
    if not lock_dir.is_dir():
        return removed
    for entry in lock_dir.iterdir():
        if not entry.name.endswith("_filelock"):
            continue
        prefix = entry.name[:6]
        if not prefix.isdigit() or alive.get(prefix) is True:
            continue
        if prefix not in dead and (prefix in in_use or prefix in live_segments):
            continue
        try:
            if prefix not in dead and now - entry.stat().st_mtime < min_age_s:
                continue
            entry.unlink()
            removed.append(str(entry))
        except (FileNotFoundError, PermissionError):
            continue
    return removed
