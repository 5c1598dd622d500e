"""A local (or shared) directory as storage: atomic writes (a rename over the old file, the
directory fsynced), conditional writes under a lock file, and one-line errors of the disk."""

from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from gpn_scale.io.storage.base import ErrorType, ObjectInfo, Storage, StorageError, noun, one_line


class LocalStorage(Storage):
    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        error: ErrorType = StorageError,
        subject: str = "storage root",
    ) -> None:
        self.root = Path(os.path.abspath(os.path.expanduser(os.fspath(root))))
        self.uri = str(self.root)
        self.error = error
        self.subject = subject

    def _path(self, key: str) -> Path:
        return self.root / key if key else self.root

    def _fail(self, action: str, path: Path, exc: OSError) -> Exception:
        return self.error(os_error_line(action, path, exc, self.subject))

    def put_file(self, local_path: Path, key: str) -> ObjectInfo:
        dest = self._path(key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.replace(local_path, dest)  # same filesystem: free and atomic
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
                shutil.copyfile(local_path, tmp)
                _fsync_file(tmp)
                os.replace(tmp, dest)
                os.unlink(local_path)
            st = dest.stat()
        except OSError as exc:
            raise self._fail("write file", dest, exc) from exc
        return ObjectInfo(size=st.st_size, mtime_ns=st.st_mtime_ns)

    def get_file(self, key: str, local_path: Path) -> None:
        src = self._path(key)
        try:
            local_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, local_path)
        except FileNotFoundError as exc:
            raise self.error(
                f"{noun(self.subject)} file {src} is missing; it was deleted or "
                "never completely written"
            ) from exc
        except OSError as exc:
            raise self._fail("read", src, exc) from exc

    def put_bytes(self, key: str, data: bytes) -> None:
        dest = self._path(key)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)  # atomic: readers never see half a file
            fsync_dir(dest.parent)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._fail("write", dest, exc) from exc

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as exc:
            raise self._fail("read", self._path(key), exc) from exc

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        data = self.get_bytes(key)
        return None if data is None else (data, _digest(data))

    def put_if(self, key: str, data: bytes, version: str | None) -> str | None:
        with self._locked(self._path(key)):
            current = self.get_versioned(key)
            if (current[1] if current else None) != version:
                return None
            self.put_bytes(key, data)
        return _digest(data)

    @contextlib.contextmanager
    def _locked(self, dest: Path) -> Iterator[None]:
        """Hold `.<name>.lock` beside `dest` (created with O_EXCL: one holder at a time, also
        across the nodes of a shared filesystem). A lock older than LOCK_STALE_S was left by
        a process that died inside the few milliseconds it is held: broken."""
        lock = dest.with_name(f".{dest.name}.lock")
        deadline = time.monotonic() + 3 * LOCK_STALE_S
        while True:
            try:
                lock.parent.mkdir(parents=True, exist_ok=True)
                os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                break
            except FileExistsError:
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - lock.stat().st_mtime > LOCK_STALE_S:
                        lock.unlink(missing_ok=True)
                        continue
                if time.monotonic() > deadline:
                    raise self.error(
                        f"{lock} stayed locked for {3 * LOCK_STALE_S:.0f}s; remove it if no "
                        "job is using this run"
                    ) from None
                time.sleep(0.005)
            except OSError as exc:
                raise self._fail("lock", lock, exc) from exc
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            raise self._fail("delete", self._path(key), exc) from exc

    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        base = self._path(prefix.rstrip("/"))
        out: dict[str, ObjectInfo] = {}
        if not base.is_dir():
            return out
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                p = Path(dirpath) / name
                try:
                    st = p.stat()
                except FileNotFoundError:  # deleted while listing
                    continue
                out[p.relative_to(self.root).as_posix()] = ObjectInfo(
                    size=st.st_size, mtime_ns=st.st_mtime_ns
                )
        return out

    def list_dirs(self) -> builtins.list[str]:  # (`list` is a method in here)
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self._fail("list", self.root, exc) from exc

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix.rstrip("/")), ignore_errors=True)

    def preflight(self) -> None:
        probe = self.root / f".preflight-{uuid.uuid4().hex[:12]}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise self._fail(f"write to {noun(self.subject)} directory", self.root, exc) from exc

    def local_dir(self, key: str) -> Path | None:
        return self._path(key.rstrip("/"))


# Errors of the disk, not of the program: full, over quota, read-only, refused, failing.
DISK_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
)


def os_error_line(action: str, path: str | os.PathLike[str], exc: OSError, subject: str) -> str:
    """`cannot <action> <path>: <the error>; <the fix>`: one line for a failed file operation,
    `subject` naming the setting that chose the place ("run_dir", "checkpoint root")."""
    if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"fix its permissions or choose a writable {subject}"
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = f"free disk space or choose another {subject}"
    elif exc.errno == errno.ENOTDIR or isinstance(exc, FileExistsError):
        fix = f"a file is in the way of the directory; choose another {subject}"
    else:
        fix = f"check the {subject}"
    return f"cannot {action} {path}: {one_line(exc)}; {fix}"


def writable_dir(directory: str | os.PathLike[str]) -> bool:
    """Whether a file can be created in the existing `directory`: a probe file created and
    removed (os.access alone is not enough: root passes it on a read-only mount)."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    try:
        fd, path = tempfile.mkstemp(prefix=".gpn-probe-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(path)
    return True


LOCK_STALE_S = 10.0  # a put_if lock is held for milliseconds; older means its holder died


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries durable (a new or renamed file in it survives a crash)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on directories
    finally:
        os.close(fd)
