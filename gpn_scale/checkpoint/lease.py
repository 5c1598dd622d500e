"""Run ownership: one job at a time trains a run, recorded as a lease in its checkpoint root.

`<checkpoint root>/LEASE` (JSON, written through gpn_scale.io.storage, so local or s3://):
owner (the SLURM job id, else host + pid), host, pid, started, heartbeat (epoch seconds),
ttl_s. Rank 0 takes it before the run writes anything, a background thread renews the
heartbeat every ttl_s / 5, and it is deleted when the trainer exits. A lease is *live* while
its heartbeat is younger than its ttl_s; a trainer that finds a live lease of another owner
refuses in one line (exit 2) unless told to take the run over (`--take-over`). The same
owner (a requeued SLURM job keeps its job id) takes its own lease back at once; a dead job's
lease goes stale after ttl_s.

Without atomic create-if-absent on every store, two jobs starting within the same second could
both take it: the launchers (`slurm/sweep.sh`, `sweep submit`) therefore also skip runs with a
job in squeue, and the lease is the guard for everything they cannot see.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from gpn_scale.core.config import ConfigError
from gpn_scale.io.storage import Storage

LEASE = "LEASE"


class LeaseHeld(ConfigError):
    """Another job holds a live lease on the run."""


def owner_id(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if job:
        return f"slurm-job-{job}"
    return f"{socket.gethostname()}-pid-{os.getpid()}"


def read_lease(storage: Storage) -> dict[str, Any] | None:
    raw = storage.get_bytes(LEASE)
    if raw is None:
        return None
    try:
        lease = json.loads(raw)
    except ValueError:
        return None
    return lease if isinstance(lease, dict) else None


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
        self._started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False

    def _record(self) -> bytes:
        return json.dumps(
            {
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started": self._started,
                "heartbeat": time.time(),
                "ttl_s": self.ttl_s,
            }
        ).encode()

    def acquire(self, take_over: bool = False) -> str | None:
        """Take the lease; returns a line to log when a live or stale lease was replaced.
        Raises LeaseHeld (one line) when another owner's lease is live and not take_over."""
        old = read_lease(self.storage)
        note = None
        if old and old.get("owner") != self.owner:
            if is_live(old) and not _dead_here(old):
                if not take_over:
                    raise LeaseHeld(
                        f"{self.storage.child_uri(LEASE)}: the run is being trained by "
                        f"{describe(old)}; wait for that job or cancel it, or pass "
                        "--take-over to take the run over (only once it has stopped)"
                    )
                note = f"lease: took the run over from {describe(old)} (--take-over)"
            else:
                note = f"lease: replaced the stale lease of {describe(old)}"
        self.storage.put_bytes(LEASE, self._record())
        self.held = True
        self._thread = threading.Thread(target=self._beat, name="gpn-lease", daemon=True)
        self._thread.start()
        return note

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 5):
            try:
                current = read_lease(self.storage)
                if current and current.get("owner") != self.owner:
                    return  # taken over: never write over the new owner's lease
                self.storage.put_bytes(LEASE, self._record())
            except Exception:  # noqa: BLE001 - a missed heartbeat is retried; training goes on
                continue

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if not self.held:
            return
        self.held = False
        try:
            current = read_lease(self.storage)
            if current is None or current.get("owner") == self.owner:
                self.storage.delete(LEASE)
        except Exception:  # noqa: BLE001 - a leftover lease goes stale after ttl_s
            pass
