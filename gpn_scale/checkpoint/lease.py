"""Run ownership: one job at a time trains a run, recorded as a lease in its checkpoint root.

`<checkpoint root>/LEASE` (JSON, written through gpn_scale.io.storage, so local or s3://):
owner (the SLURM job id, else host + pid), host, pid, token (new at each acquire: which
process holds it), started, heartbeat (epoch seconds), ttl_s. Rank 0 takes it before the run
writes anything, a background thread renews the heartbeat every ttl_s / 5, and it is deleted
when the trainer exits. A lease is *live* while its heartbeat is younger than its ttl_s; a
trainer that finds a live lease of another owner refuses in one line (exit 2) unless told to
take the run over (`--take-over`). The same owner (a requeued SLURM job keeps its job id)
takes its own lease back at once; a dead job's lease goes stale after ttl_s.

Every write of the lease is conditional (`Storage.put_if`: O_EXCL lock file locally, S3's
If-None-Match / If-Match): it is taken only where there is none or where it is still the lease
that was judged stale (or taken over), and renewed only while it is still this process's. So
two jobs starting together cannot both hold it: one write lands, the other then finds the
winner's live lease and refuses. A write read back with another token (a store that ignores
the conditions) counts as lost too.

A holder whose lease was replaced (another job's `--take-over`, its own job requeued) has lost
the run: the heartbeat thread looks every min(ttl_s / 5, CHECK_S) seconds and sets `lost` (one
line), which the trainer reads at each step (in the stop all-reduce it runs with preemption
on); `check()` reads the lease at once (the trainer calls it before each checkpoint write).
The trainer then stops without writing anything more.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from gpn_scale.core.config import ConfigError
from gpn_scale.io.storage import Storage

LEASE = "LEASE"
CHECK_S = 5.0  # the heartbeat thread looks for a take-over at least this often (one read)
ACQUIRE_TRIES = 5  # conditional writes that lose to another writer: read and judge again
LOST_ON_RANK_0 = "another job took this run's lease over (see rank 0); stopping, nothing saved"


class LeaseHeld(ConfigError):
    """Another job holds a live lease on the run."""


class LeaseLost(ConfigError):
    """Another job took this run's lease over: this trainer stops writing to the run."""


def owner_id(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if job:
        return f"slurm-job-{job}"
    return f"{socket.gethostname()}-pid-{os.getpid()}"


def _parse(raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        lease = json.loads(raw)
    except ValueError:
        return None
    return lease if isinstance(lease, dict) else None


def read_lease(storage: Storage) -> dict[str, Any] | None:
    return _parse(storage.get_bytes(LEASE))


def is_live(lease: Mapping[str, Any] | None, now: float | None = None) -> bool:
    if not lease:
        return False
    try:
        age = (time.time() if now is None else now) - float(lease["heartbeat"])
        return age < float(lease["ttl_s"])
    except (KeyError, TypeError, ValueError):
        return False


def _dead_here(lease: Mapping[str, Any]) -> bool:
    """The lease's process ran on this host and is gone (a kill -9, a crash): stale now."""
    if lease.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(lease["pid"]), 0)
    except ProcessLookupError:
        return True
    except (KeyError, TypeError, ValueError, PermissionError):
        return False
    return False


def describe(lease: Mapping[str, Any], now: float | None = None) -> str:
    age = (time.time() if now is None else now) - float(lease.get("heartbeat", 0))
    return f"{lease.get('owner')} on host {lease.get('host')} (heartbeat {age:.0f}s ago)"


class RunLease:
    """Take, renew and release the lease of one checkpoint root (rank 0 only)."""

    def __init__(self, storage: Storage, ttl_s: float, owner: str | None = None) -> None:
        self.storage = storage
        self.ttl_s = float(ttl_s)
        self.owner = owner or owner_id()
        self.token = uuid.uuid4().hex
        self._started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._io = threading.Lock()  # the heartbeat thread and the trainer's check()
        self.held = False
        self.lost: str | None = None  # one line, set once another job took the run

    def _record(self) -> bytes:
        return json.dumps(
            {
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "token": self.token,
                "started": self._started,
                "heartbeat": time.time(),
                "ttl_s": self.ttl_s,
            }
        ).encode()

    def _mine(self, seen: tuple[bytes, str] | None) -> bool:
        return seen is not None and (_parse(seen[0]) or {}).get("token") == self.token

    def acquire(self, take_over: bool = False) -> str | None:
        """Take the lease; returns a line to log when a live or stale lease was replaced.
        Raises LeaseHeld (one line) when another owner's lease is live and not take_over."""
        for _ in range(ACQUIRE_TRIES):
            seen = self.storage.get_versioned(LEASE)
            note = self._judge(_parse(seen[0]) if seen else None, take_over)
            version = self.storage.put_if(LEASE, self._record(), seen[1] if seen else None)
            if version is not None and self._mine(self.storage.get_versioned(LEASE)):
                self.held = True
                self._thread = threading.Thread(target=self._beat, name="gpn-lease", daemon=True)
                self._thread.start()
                return note
            # another job wrote the lease since we read it: judge what it wrote
        raise LeaseHeld(
            f"{self.storage.child_uri(LEASE)} kept changing while this job tried to take it "
            f"({ACQUIRE_TRIES} tries): other jobs are starting on this run; start one at a time"
        )

    def _judge(self, old: Mapping[str, Any] | None, take_over: bool) -> str | None:
        """None to take a free lease or our own back; a note to replace another's; or
        LeaseHeld."""
        if not old or old.get("owner") == self.owner:
            return None
        if not is_live(old) or _dead_here(old):
            return f"lease: replaced the stale lease of {describe(old)}"
        if not take_over:
            raise LeaseHeld(
                f"{self.storage.child_uri(LEASE)}: the run is being trained by "
                f"{describe(old)}; wait for that job or cancel it, or pass "
                "--take-over to take the run over (only once it has stopped)"
            )
        return f"lease: took the run over from {describe(old)} (--take-over)"

    def check(self, renew: bool = False) -> str | None:
        """Read the lease now; `renew` also writes a fresh heartbeat while it is ours (a lease
        deleted under us is put back when nobody else took it). Returns `lost`: None while
        the lease is ours, else the one line saying who took the run."""
        with self._io:
            for _ in range(ACQUIRE_TRIES):
                if self.lost or not self.held:
                    return self.lost
                seen = self.storage.get_versioned(LEASE)
                if seen is not None and not self._mine(seen):
                    current = _parse(seen[0])
                    who = describe(current) if current else "another job"
                    self.lost = (
                        f"{self.storage.child_uri(LEASE)}: this run was taken over by {who}; "
                        "this trainer stops here and writes nothing more (that job trains "
                        "the run now)"
                    )
                    return self.lost
                if seen is not None and not renew:
                    return None
                version = seen[1] if seen else None
                if self.storage.put_if(LEASE, self._record(), version) is not None:
                    return None
            return None  # it kept changing: the next check decides

    def _beat(self) -> None:
        renewed = time.monotonic()
        while not self._stop.wait(min(self.ttl_s / 5, CHECK_S)):
            due = time.monotonic() - renewed >= self.ttl_s / 5 * 0.99
            try:
                if self.check(renew=due) is not None:
                    return  # taken over: never write over the new owner's lease
            except Exception:  # noqa: BLE001 - a missed heartbeat is retried; training goes on
                continue
            if due:
                renewed = time.monotonic()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if not self.held:
            return
        with self._io:
            self.held = False
            try:
                if self._mine(self.storage.get_versioned(LEASE)):
                    self.storage.delete(LEASE)
            except Exception:  # noqa: BLE001 - a leftover lease goes stale after ttl_s
                pass


def held_by_another(storage: Storage, mine: RunLease | None) -> bool:
    """Whether the root holds a lease that is not `mine` (or `mine` was taken over): the run
    folders are another job's then, and a failed start removes none of them. False when the
    lease cannot be read."""
    try:
        if mine is not None:
            return mine.check() is not None
        return storage.get_bytes(LEASE) is not None
    except Exception:  # noqa: BLE001 - unreadable: as before the lease existed
        return False
