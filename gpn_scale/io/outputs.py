"""Checks on where a command will write, made before it does any work.

A command that reads for minutes and then finds its `--out` unwritable loses that work; these
checks run first and fail with one line naming the flag, the path and the fix. Nothing is
left behind: for a path that does not exist yet, its first existing ancestor decides (it must
be a writable directory: access(2), the mount's read-only flag, and an empty directory made
and removed there, which is what catches /proc and friends for root). S3 destinations are
left to the writer (a probe would write).

    from gpn_scale.io.outputs import check_out_dir, check_out_file
    check_out_dir(args.out, "--out", error=MyError)                 # a directory to fill
    check_out_file(args.out, "--out", overwrite=args.overwrite)     # one file to write

Like the rest of gpn_scale.io, this imports nothing else of gpn_scale: callers pass their own
error type (`error=`), so each command keeps its exit-2 error.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from gpn_scale.io.storage import StorageError, is_s3

ErrorType = Callable[[str], Exception]


def _first_existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe


def _writable_dir(directory: Path, probe: bool) -> str | None:
    """Why `directory` (an existing directory) cannot be written to, or None."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return "is not writable (permissions or a read-only file system)"
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return "is on a read-only file system"
    except OSError:
        pass
    if probe:  # root passes access(2) everywhere; /proc and friends still refuse a mkdir
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".gpn-write-probe-", dir=directory))
        except OSError as err:
            return f"refuses new entries ({err.strerror or type(err).__name__})"
    return None


def _check_parent_writable(
    path: Path, given: str, flag: str, error: ErrorType, probe: bool
) -> None:
    parent = _first_existing(path.parent if path.parent != path else path)
    if not parent.is_dir():
        raise error(f"{flag} {given}: {parent} is a file, not a directory; choose another {flag}")
    why = _writable_dir(parent, probe)
    if why:
        raise error(f"{flag} {given}: {parent} {why}; choose another {flag}")


def check_out_dir(
    path: str, flag: str = "--out", *, error: ErrorType = StorageError, probe: bool = True
) -> bool:
    """One line (raised as `error`) when directory `path` cannot be created or written to;
    returns whether it exists already. An s3:// destination returns False unchecked.
    `probe`: also create and remove an empty directory there (the one test that holds for
    root, who passes every permission check); off for commands that promise to write
    nothing (`train --dry-run`)."""
    if is_s3(str(path)):
        return False
    target = Path(os.path.expanduser(str(path))).absolute()
    if target.exists() and not target.is_dir():
        raise error(f"{flag} {path}: exists and is a file, not a directory; choose another {flag}")
    if target.is_dir():
        why = _writable_dir(target, probe)
        if why:
            raise error(f"{flag} {path}: the directory {why}; choose another {flag}")
        return True
    _check_parent_writable(target, str(path), flag, error, probe)
    return False


def check_out_file(
    path: str,
    flag: str = "--out",
    *,
    overwrite: bool = False,
    error: ErrorType = StorageError,
    probe: bool = True,
) -> bool:
    """One line (raised as `error`) when file `path` cannot be written: it is a directory, it
    exists and `overwrite` is false (the fix names --overwrite), or its directory cannot be
    created or written. Returns whether it exists. An s3:// destination returns False
    unchecked."""
    if is_s3(str(path)):
        return False
    target = Path(os.path.expanduser(str(path))).absolute()
    if target.is_dir():
        raise error(f"{flag} {path}: is a directory; give a file path for {flag}")
    exists = target.exists()
    if exists and not overwrite:
        raise error(f"{flag} {path}: already exists; pass --overwrite to replace it")
    if exists and not os.access(target, os.W_OK):
        raise error(
            f"{flag} {path}: the file is not writable (permissions or a read-only file "
            f"system); choose another {flag}"
        )
    _check_parent_writable(target, str(path), flag, error, probe)
    return exists
