"""Where the ranks write a checkpoint before uploading it, where a load downloads one, and
the one line for a staging disk that ran out of room.

Each rank stages into its own `rank_<r>` directory under the staging root: `<root>/.staging`
for a local root (so "upload" is a rename), `$GPN_CKPT_STAGING` or the temp dir for S3, or the
`staging_dir` a library caller passes.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

from gpn_scale.io.storage import LocalStorage, Storage

_SHORT_WRITE = ("unexpected pos", "file write failed", "no space left on device")


class Staging:
    """The staging root of the checkpoints of `storage` (see the module docstring)."""

    def __init__(self, storage: Storage, staging_dir: str | None) -> None:
        self._given = staging_dir is not None
        self._local = isinstance(storage, LocalStorage)
        if staging_dir is not None:
            self.root = Path(staging_dir).expanduser().absolute()
        elif isinstance(storage, LocalStorage):
            self.root = storage.root / ".staging"
        else:
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", storage.uri.removeprefix("s3://"))
            base = os.environ.get("GPN_CKPT_STAGING") or os.path.join(
                tempfile.gettempdir(), "gpn_scale_ckpt_staging"
            )
            self.root = Path(base) / safe

    def rank_dir(self, rank: int) -> Path:
        return self.root / f"rank_{rank:05d}"

    def fix(self) -> str:
        """The setting a user changes for a writable staging directory: the trainer's key or
        variable, not the manager's argument (which only a library caller passes)."""
        if self._given:
            return "pass a writable staging_dir"
        if self._local:  # <root>/.staging: the root itself
            return (
                "make checkpoint.root writable, or set checkpoint.root=DIR to a writable "
                "directory (its .staging holds each save)"
            )
        return "set GPN_CKPT_STAGING to a writable local directory"

    def download_dir(self, rank: int) -> Path:
        """A new directory of its own for one load's downloads (removed after the load): two
        readers of one S3 checkpoint on a machine (evals, a resume) share the staging root,
        but never their files, so neither deletes them under the other. Those of processes
        gone from this host (a load that failed) are removed here."""
        stage, prefix = self.rank_dir(rank), f"load-{socket.gethostname()}-"
        stage.mkdir(parents=True, exist_ok=True)
        for old in stage.glob(f"{prefix}*"):
            pid = old.name[len(prefix) :].split("-")[0]
            if pid.isdigit() and not _process_alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=stage))

    def disk_full(self, exc: BaseException, stage: Path) -> str:
        """The one line for a staged write that ran out of disk (ENOSPC, EDQUOT: also inside
        DCP's per-rank failures, or torch's "unexpected pos" of a short write), else ''."""
        if not _out_of_space(exc, stage):
            return ""
        if self._local:
            fix = "set checkpoint.root to a disk with room (its .staging holds each save)"
        else:
            fix = "set GPN_CKPT_STAGING to a local disk with room"
        return (
            f"no space left on device writing the checkpoint into the staging directory "
            f"{self.root}; free space there (old checkpoints, caches) or {fix}"
        )


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


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
