"""Where files live outside the process: a local (or shared) directory, or an S3 prefix.

Both backends speak in *keys* relative to their root (`step_000000100/__0_0.distcp`,
`train/index.json`), so callers never build paths or URLs themselves. The data pipeline
(`gpn_scale.data.storage.Location`) and the checkpoint manager use this one module, so the
two agree on everything below.

Endpoint: the first of `S3_ENDPOINT_URL` (streaming's convention), `AWS_ENDPOINT_URL_S3`,
`AWS_ENDPOINT_URL` (boto3's own, in boto3's order; both skipped when
`AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true`, as boto3 does) that is set, else AWS. A custom
endpoint gets path-style addressing (MinIO, moto, most S3-compatible stores need it).
Streaming's own downloads pass only `S3_ENDPOINT_URL` and leave the others to boto3, which
resolves them in the same order, so shards and metadata come from the same place.

Credentials: boto3's normal chain (environment, profile, instance role).

Retries: botocore's own are switched off and replaced by one bounded exponential-backoff loop
(`RetryPolicy`: `GPN_S3_RETRIES` attempts, default 5; delays `GPN_S3_BACKOFF_S` * 2**i,
default 0.5 s, capped at 8 s), so that the number of attempts and the delays are known (and
short in tests), and so that errors that retrying will not cure (credentials, a missing
bucket) fail on the first attempt with one line. Retried: no connection, a connection reset
or a body cut short, timeouts, 5xx and throttling (503 SlowDown), and a transfer that arrived
corrupted (botocore's FlexibleChecksumError; BadDigest). The same loop serves the shard
downloads of the data loader (gpn_scale.data.s3_download replaces streaming's own client),
and a multipart upload retries each part on its own, never the whole file. Requests that
succeed only after retrying are said on stderr (`RETRY_LOG`: one line a minute at most, with
the count), so a run slowed down by a throttling store says so. Timeouts:
`GPN_S3_CONNECT_TIMEOUT_S` (default 5), `GPN_S3_READ_TIMEOUT_S` (default 60). Multipart
uploads/downloads: `GPN_S3_MULTIPART_MB` (default 64) per part.

Errors: every failure is one line naming the problem and the fix, raised as the caller's own
error type (`error=`, default `StorageError`) so that this package imports nothing else of
gpn_scale; `subject` names what the root is to the user ("checkpoint root", "dataset root").

Conditional writes (`get_versioned` / `put_if`, for the run lease): a write that lands only if
the object is still the version the writer read (or still absent), so two writers can never
both win. S3: `If-Match` / `If-None-Match: *` on the PUT (AWS since 2024, MinIO, moto; a store
that ignores them needs the lease's read-back and heartbeat checks); local: the read, compare
and replace under a lock file created with O_CREAT | O_EXCL beside the object.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import hashlib
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
ErrorType = Callable[[str], Exception]


class StorageError(Exception):
    """A storage failure; the message is one line naming the problem and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def one_line(exc: BaseException, limit: int = 300) -> str:
    """`Type: message` of an exception, squeezed onto one line and cut to `limit` characters."""
    text = " ".join(str(exc).split()) or repr(exc)
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------------------------
# URLs
# --------------------------------------------------------------------------------------------


def is_s3(path: str) -> bool:
    return str(path).startswith("s3://")


def join(root: str, *parts: str) -> str:
    """Join path parts; for s3:// keep forward slashes and no duplicate separators."""
    if is_s3(root):
        out = root.rstrip("/")
        for part in parts:
            out += "/" + part.strip("/")
        return out
    return os.path.join(root, *parts)


def split_s3(url: str, error: ErrorType = StorageError) -> tuple[str, str]:
    """'s3://bucket/a/b' -> ('bucket', 'a/b')."""
    rest = str(url)[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise error(f"{url}: no bucket in the S3 URL; write it as s3://bucket/prefix")
    return bucket, key.strip("/")


# --------------------------------------------------------------------------------------------
# Endpoint, retry policy, client
# --------------------------------------------------------------------------------------------

ENDPOINT_VARIABLES = ("S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def endpoint_setting() -> tuple[str, str] | None:
    """(variable, url) of the S3 endpoint in effect, or None for AWS's own."""
    ignore = os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").strip().lower() == "true"
    for name in ENDPOINT_VARIABLES:
        if ignore and name != "S3_ENDPOINT_URL":
            continue
        value = os.environ.get(name, "").strip()
        if value:
            return name, value
    return None


def endpoint_url() -> str | None:
    """The S3 endpoint URL in effect (see the module docstring), or None for AWS."""
    setting = endpoint_setting()
    return setting[1] if setting else None


# scheme://userinfo@ : the userinfo ends at the first '@' before any '/', '?', '#' or blank.
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^/?#@\s\"']+)@")


def _mask_userinfo(match: re.Match[str]) -> str:
    user, colon, _ = match["info"].partition(":")
    return f"{match['scheme']}{user}:***@" if colon else f"{match['scheme']}***@"


def redact_urls(text: str) -> str:
    """`text` with the userinfo of every URL in it masked (`user:***@`, or `***@` for a bare
    token): an endpoint may carry credentials (`S3_ENDPOINT_URL=http://user:pass@host`) and
    botocore repeats it in its errors; no message or log line prints the password."""
    return _USERINFO.sub(_mask_userinfo, text) if "@" in text else text


def _where() -> str:
    setting = endpoint_setting()
    return f"endpoint {redact_urls(setting[1])}" if setting else "the AWS default endpoint"


def _endpoint_variable() -> str:
    setting = endpoint_setting()
    return setting[0] if setting else "S3_ENDPOINT_URL"


def env_number(name: str, default: float, error: ErrorType = StorageError) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise error(f"{name}={raw!r} is not a number; unset it or give a number") from None


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts per request and the exponential backoff between them (transient errors only)."""

    attempts: int = 5
    backoff_s: float = 0.5
    max_delay_s: float = 8.0

    @classmethod
    def from_env(
        cls,
        attempts: int | None = None,
        backoff_s: float | None = None,
        *,
        error: ErrorType = StorageError,
    ) -> RetryPolicy:
        """Explicit values, else GPN_S3_RETRIES / GPN_S3_BACKOFF_S, else the defaults."""
        n = attempts if attempts is not None else env_number("GPN_S3_RETRIES", 5, error)
        b = backoff_s if backoff_s is not None else env_number("GPN_S3_BACKOFF_S", 0.5, error)
        return cls(attempts=max(1, int(n)), backoff_s=max(0.0, float(b)))

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        return float(min(self.backoff_s * 2 ** (attempt - 1), self.max_delay_s))


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class RetryLog:
    """Says that S3 requests succeed only after retrying: a run that goes on slowly under a
    throttling store (503 SlowDown) says so, in one line at most every `interval_s` (the first
    at once), with the number of retries since the last line. A request that fails for good
    is not counted here: its error says `after N attempts`. `clock` and `say` are for tests."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = _to_stderr,
        interval_s: float = 60.0,
    ) -> None:
        self.clock, self.say, self.interval_s = clock, say, interval_s
        self._lock = threading.Lock()
        self._retries = 0  # since the last line
        self._requests = 0
        self._last: float | None = None  # clock() of the last line

    def recovered(self, what: str, url: str, retries: int, detail: str) -> None:
        """A request (`what` on `url`) succeeded after `retries` retries, the last for `detail`."""
        with self._lock:
            self._retries += retries
            self._requests += 1
            now = self.clock()
            if self._last is not None and now - self._last < self.interval_s:
                return
            since = "" if self._last is None else f" in the last {(now - self._last) / 60:.0f} min"
            count, requests = self._retries, self._requests
            self._retries = self._requests = 0
            self._last = now
        self.say(  # botocore's detail may repeat an endpoint that carries credentials
            f"S3 retrying: {count} retr{'y' if count == 1 else 'ies'} of {requests} "
            f"request{'s' if requests != 1 else ''}{since} at {_where()} (latest: {what} {url}: "
            f"{redact_urls(detail)}); the run goes on, slower while S3 answers so "
            "(GPN_S3_RETRIES bounds the attempts per request)"
        )


RETRY_LOG = RetryLog()


_CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_EC2_METADATA_DISABLED",
    "GPN_S3_CONNECT_TIMEOUT_S",
    "GPN_S3_READ_TIMEOUT_S",
)
_CLIENTS: dict[tuple[Any, ...], Any] = {}


def s3_client(error: ErrorType = StorageError) -> Any:
    """The boto3 S3 client for the current endpoint and credentials, with botocore's retries
    off (RetryPolicy owns them). Cached per process and per environment: making a client
    costs ~0.1 s, and clients are thread-safe."""
    endpoint = endpoint_url()
    key = (os.getpid(), endpoint, *(os.environ.get(k) for k in _CREDENTIAL_VARIABLES))
    if key not in _CLIENTS:
        import boto3
        from botocore.config import Config

        config = Config(
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=env_number("GPN_S3_CONNECT_TIMEOUT_S", 5, error),
            read_timeout=env_number("GPN_S3_READ_TIMEOUT_S", 60, error),
            max_pool_connections=32,
            s3={"addressing_style": "path"} if endpoint else {},
        )
        region = os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or None
        if len(_CLIENTS) > 16:  # environments come and go in tests; keep the cache small
            _CLIENTS.clear()
        _CLIENTS[key] = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=region, config=config
        )
    return _CLIENTS[key]


# --------------------------------------------------------------------------------------------
# Errors: classify once, describe in one line
# --------------------------------------------------------------------------------------------

_AUTH_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
    "AuthFailure",
    "403",
}
_BUSY_CODES = {
    "500",
    "502",
    "503",
    "504",
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
# The store saw a corrupted upload body: the next attempt sends it again.
_CORRUPT_CODES = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch"}
# A conditional write that lost: the object changed (or appeared) since it was read.
_CONFLICT_CODES = {"PreconditionFailed", "ConditionalRequestConflict", "412"}
RETRIED = ("unreachable", "busy", "corrupt")


def classify(exc: BaseException) -> tuple[str, str]:
    """(kind, detail) for an exception chain; kind is one of 'nocreds', 'auth', 'bucket',
    'notfound', 'conflict' (a conditional write lost), 'unreachable' (no connection, a
    connection reset, a body cut short), 'busy' (5xx, throttling), 'corrupt' (a transfer that
    failed its checksum), 'fatal'."""
    from botocore import exceptions as bexc

    seen: BaseException | None = exc
    chain: list[BaseException] = []
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for e in chain:
        if isinstance(e, (bexc.NoCredentialsError, bexc.PartialCredentialsError)):
            return "nocreds", one_line(e)
        if isinstance(e, bexc.FlexibleChecksumError):
            return "corrupt", one_line(e)
        if isinstance(e, bexc.ClientError):
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code == "NoSuchBucket":
                return "bucket", one_line(e)
            if code in _CONFLICT_CODES or status == "412":
                return "conflict", one_line(e)
            if code in _AUTH_CODES or status == "403":
                return "auth", one_line(e)
            if code in _NOT_FOUND_CODES or status == "404":
                return "notfound", one_line(e)
            if code in _BUSY_CODES or status.startswith("5"):
                return "busy", one_line(e)
            if code in _CORRUPT_CODES:
                return "corrupt", one_line(e)
            return "fatal", one_line(e)
        if isinstance(
            e,
            (
                bexc.EndpointConnectionError,
                bexc.ConnectionClosedError,
                bexc.ConnectTimeoutError,
                bexc.ReadTimeoutError,
                bexc.HTTPClientError,
                bexc.IncompleteReadError,
                ConnectionError,
                TimeoutError,
            ),
        ):
            return "unreachable", one_line(e)
    # boto3's S3UploadFailedError keeps only the text of the ClientError it wraps.
    text = one_line(exc)
    if "NoSuchBucket" in text:
        return "bucket", text
    if any(code in text for code in _AUTH_CODES if not code.isdigit()):
        return "auth", text
    if any(
        word in text
        for word in (
            "Could not connect",
            "Connection was closed",
            "timed out",
            "Max retries",
            "Connection refused",
        )
    ):
        return "unreachable", text
    if type(exc).__name__ == "RetriesExceededError":  # s3transfer download retries
        return "unreachable", text
    return "fatal", text


def describe(
    kind: str,
    detail: str,
    *,
    url: str,
    what: str,
    attempts: int | None = None,
    subject: str = "storage root",
) -> str:
    """The one-line message for a classified failure of `what` on `url` (no password of
    the endpoint in it: botocore's `detail` repeats the URL)."""
    detail = redact_urls(detail)
    where = _where()
    var = _endpoint_variable()
    after = f" after {attempts} attempt{'s' if attempts != 1 else ''}" if attempts else ""
    if kind == "nocreds":
        return (
            f"no S3 credentials for {url} (trying to {what}); set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / an instance role)"
        )
    if kind == "auth":
        return (
            f"S3 rejected the credentials for {url} at {where} while trying to {what} "
            f"({detail}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's "
            "permissions"
        )
    if kind == "bucket":
        bucket = split_s3(url)[0] if is_s3(url) else url
        return (
            f"S3 bucket '{bucket}' does not exist at {where} ({url}); create it or fix the "
            f"{subject} (and {var})"
        )
    if kind == "notfound":
        return f"{url}: no such object at {where}; check the path"
    if kind == "unreachable":
        return (
            f"S3 unreachable: cannot reach the S3 endpoint ({where}) to {what} {url}{after} "
            f"({detail}); check {var} and the network"
        )
    if kind == "busy":
        return (
            f"S3 kept failing at {where} to {what} {url}{after} ({detail}); try again "
            f"later, or check {var}"
        )
    if kind == "corrupt":
        return (
            f"S3 transfers kept arriving corrupted (checksum mismatch) at {where} trying to "
            f"{what} {url}{after} ({detail}); check the network path to {var} (a proxy "
            "that rewrites bodies?), then try again"
        )
    return f"S3 error for {url} at {where} while trying to {what}: {detail}"


class NotFound(Exception):
    """The object does not exist (callers decide whether that is an error)."""


class Conflict(Exception):
    """A conditional write found the object changed since it was read (another writer won)."""


def call(
    what: str,
    url: str,
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    error: ErrorType = StorageError,
    subject: str = "storage root",
) -> T:
    """Run one S3 request, retrying transient failures with the policy's backoff.

    Raises NotFound for a missing object, Conflict for a conditional write that lost,
    `error` (one line) for everything else."""
    last = ""
    for attempt in range(1, policy.attempts + 1):
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - classified below, re-raised as `error`
            kind, detail = classify(exc)
            last = detail
            if kind == "notfound":
                raise NotFound(detail) from exc
            if kind == "conflict":
                raise Conflict(detail) from exc
            if kind not in RETRIED or attempt == policy.attempts:
                raise error(
                    describe(
                        kind,
                        detail,
                        url=url,
                        what=what,
                        subject=subject,
                        attempts=attempt if kind in RETRIED else None,
                    )
                ) from exc
            time.sleep(policy.delay(attempt))
            continue
        if attempt > 1:
            RETRY_LOG.recovered(what, url, attempt - 1, last)
        return result
    raise AssertionError("unreachable")


def _noun(subject: str) -> str:
    """'checkpoint' for 'checkpoint root' (for messages about files and directories under it)."""
    return subject.removesuffix(" root")


# --------------------------------------------------------------------------------------------
# The storage interface
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectInfo:
    """What a listing says about one stored file (cheap to get for many files at once)."""

    size: int
    etag: str | None = None  # S3 only: changes whenever the object is rewritten
    mtime_ns: int | None = None  # local only: changes whenever the file is rewritten


class Storage(ABC):
    """A flat key -> bytes store rooted at `uri`; keys use '/' separators."""

    uri: str

    def child_uri(self, key: str) -> str:
        return f"{self.uri.rstrip('/')}/{key}" if key else self.uri

    @abstractmethod
    def put_file(self, local_path: Path, key: str) -> ObjectInfo:
        """Store a local file under `key` (the local file may be moved away). Returns its info."""

    @abstractmethod
    def get_file(self, key: str, local_path: Path) -> None:
        """Copy `key` to `local_path`; the caller's error if it is missing."""

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Write a small object atomically (readers see the old or the new content, never half)."""

    @abstractmethod
    def get_bytes(self, key: str) -> bytes | None:
        """A small object's content, or None when it does not exist."""

    @abstractmethod
    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        """(content, version) of a small object, or None when it does not exist; the version
        changes whenever the object is rewritten (for `put_if`)."""

    @abstractmethod
    def put_if(self, key: str, data: bytes, version: str | None) -> str | None:
        """Write a small object only if it is still at `version` (None: only if it does not
        exist), atomically with that check. The new version, or None when another writer
        changed it first (nothing written)."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether `key` exists (a missing S3 bucket is an error, not False)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete one file; missing is fine."""

    @abstractmethod
    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        """All files under `prefix` (recursive): key relative to the root -> info."""

    @abstractmethod
    def list_dirs(self) -> builtins.list[str]:  # (`list` is a method in here)
        """Names of the immediate sub-directories of the root."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Delete every file under `prefix` ('step_000000100/'); missing is fine."""

    @abstractmethod
    def preflight(self) -> None:
        """Cheaply prove that the root can be written; the caller's error naming the fix if not."""

    def local_dir(self, key: str) -> Path | None:
        """A directory readers can open directly (local storage), else None (download first)."""
        return None


# --------------------------------------------------------------------------------------------
# Local directory (also a shared filesystem seen by all nodes)
# --------------------------------------------------------------------------------------------


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
                f"{_noun(self.subject)} file {src} is missing; it was deleted or "
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
            raise self._fail(f"write to {_noun(self.subject)} directory", self.root, exc) from exc

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


# --------------------------------------------------------------------------------------------
# S3 (or any S3-compatible endpoint)
# --------------------------------------------------------------------------------------------


class S3Storage(Storage):
    """s3://bucket/prefix through boto3 (endpoint, credentials, retries: see the module)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        retries: int | None = None,
        backoff_s: float | None = None,
        multipart_mb: float | None = None,
        error: ErrorType = StorageError,
        subject: str = "storage root",
    ) -> None:
        from boto3.s3.transfer import TransferConfig

        self.error = error
        self.subject = subject
        if not bucket:
            raise error("S3 URI has no bucket; write it as s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.policy = RetryPolicy.from_env(retries, backoff_s, error=error)
        self.retries = self.policy.attempts
        self.endpoint = endpoint_url()
        mb = (
            multipart_mb
            if multipart_mb is not None
            else env_number("GPN_S3_MULTIPART_MB", 64, error)
        )
        chunk = max(5 * 1024 * 1024, int(mb * 1024 * 1024))  # S3's minimum part size is 5 MiB
        self.transfer_config = TransferConfig(
            multipart_threshold=chunk,
            multipart_chunksize=chunk,
            max_concurrency=4,
            num_download_attempts=1,
        )
        self.client = s3_client(error)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return call(what, self.uri, fn, policy=self.policy, error=self.error, subject=self.subject)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_file(self, local_path: Path, key: str) -> ObjectInfo:
        full = self._key(key)
        size = local_path.stat().st_size
        if size > self.transfer_config.multipart_threshold:
            self._put_multipart(local_path, key, size)
            return ObjectInfo(size=size)
        self._call(
            f"upload {key}",
            lambda: self.client.upload_file(
                str(local_path), self.bucket, full, Config=self.transfer_config
            ),
        )
        return ObjectInfo(size=size)

    def _put_multipart(self, local_path: Path, key: str, size: int) -> None:
        """A multipart upload whose parts are each retried on their own (s3transfer's retries
        the whole file: a 4-part upload under 40% part faults failed all of its attempts); an
        upload that fails is aborted, so no parts are left to pay for."""
        from concurrent.futures import ThreadPoolExecutor

        full, chunk = self._key(key), self.transfer_config.multipart_chunksize
        count = -(-size // chunk)
        upload = self._call(
            f"start the upload of {key}",
            lambda: self.client.create_multipart_upload(
                Bucket=self.bucket, Key=full, ChecksumAlgorithm="CRC32"
            ),
        )["UploadId"]

        def send(number: int) -> dict[str, Any]:
            with open(local_path, "rb") as f:
                f.seek((number - 1) * chunk)
                body = f.read(chunk)
            out = self.client.upload_part(
                Bucket=self.bucket, Key=full, UploadId=upload, PartNumber=number, Body=body,
                ChecksumAlgorithm="CRC32",
            )  # fmt: skip
            part = {"PartNumber": number, "ETag": out["ETag"]}
            if out.get("ChecksumCRC32"):
                part["ChecksumCRC32"] = out["ChecksumCRC32"]
            return part

        def part(number: int) -> dict[str, Any]:
            return self._call(f"upload part {number} of {count} of {key}", lambda: send(number))

        pool = ThreadPoolExecutor(max(1, self.transfer_config.max_concurrency))
        try:
            parts = list(pool.map(part, range(1, count + 1)))
            self._call(
                f"finish the upload of {key}",
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload,
                    MultipartUpload={"Parts": parts},
                ),
            )  # fmt: skip
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload)
            raise
        finally:
            pool.shutdown(wait=True)

    def get_file(self, key: str, local_path: Path) -> None:
        local_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = local_path.with_name(f".{local_path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            self._call(
                f"download {key}",
                lambda: self.client.download_file(
                    self.bucket, self._key(key), str(tmp), Config=self.transfer_config
                ),
            )
            os.replace(tmp, local_path)
        except NotFound as exc:
            raise self.error(
                f"{_noun(self.subject)} file {self.child_uri(key)} is missing; it was "
                "deleted or never completely written"
            ) from exc
        finally:
            tmp.unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        # A single PUT replaces an S3 object atomically.
        self._call(
            f"write {key}",
            lambda: self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data),
        )

    def get_bytes(self, key: str) -> bytes | None:
        try:
            return self._call(
                f"read {key}",
                lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(key))[
                    "Body"
                ].read(),
            )
        except NotFound:
            return None

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        def read() -> tuple[bytes, str]:
            out = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
            return out["Body"].read(), str(out.get("ETag", "")).strip('"')

        try:
            return self._call(f"read {key}", read)
        except NotFound:
            return None

    def put_if(self, key: str, data: bytes, version: str | None) -> str | None:
        condition = {"IfNoneMatch": "*"} if version is None else {"IfMatch": f'"{version}"'}
        try:
            out = self._call(
                f"write {key}",
                lambda: self.client.put_object(
                    Bucket=self.bucket, Key=self._key(key), Body=data, **condition
                ),
            )
        except (Conflict, NotFound):  # changed, or deleted, since `version` was read
            return None
        return str(out.get("ETag", "")).strip('"')

    def exists(self, key: str) -> bool:
        try:
            self._call(
                f"look up {key}",
                lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key)),
            )
            return True
        except NotFound:
            pass
        # A HEAD response has no body, so a missing bucket looks like a missing key: ask.
        try:
            self._call("look up the bucket", lambda: self.client.head_bucket(Bucket=self.bucket))
        except NotFound as exc:
            raise self.error(
                describe(
                    "bucket", str(exc), url=self.uri, what=f"look up {key}", subject=self.subject
                )
            ) from exc
        return False

    def delete(self, key: str) -> None:
        self._call(
            f"delete {key}",
            lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key)),
        )

    def _list_raw(self, prefix: str, delimiter: str | None) -> list[dict[str, Any]]:
        def run() -> list[dict[str, Any]]:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = delimiter
            return list(self.client.get_paginator("list_objects_v2").paginate(**kwargs))

        try:
            return self._call(f"list {prefix or '/'}", run)
        except NotFound as exc:  # NoSuchKey never comes from a listing; keep the message sane
            raise self.error(f"cannot list {self.uri}: {exc}; check the {self.subject}") from exc

    def list(self, prefix: str = "") -> dict[str, ObjectInfo]:
        base = self._key(prefix) if prefix else (f"{self.prefix}/" if self.prefix else "")
        strip = len(self.prefix) + 1 if self.prefix else 0
        out: dict[str, ObjectInfo] = {}
        for page in self._list_raw(base, None):
            for obj in page.get("Contents", []):
                out[obj["Key"][strip:]] = ObjectInfo(
                    size=int(obj["Size"]), etag=str(obj.get("ETag", "")).strip('"')
                )
        return out

    def list_dirs(self) -> builtins.list[str]:  # (`list` is a method in here)
        base = f"{self.prefix}/" if self.prefix else ""
        names: set[str] = set()
        for page in self._list_raw(base, "/"):
            for cp in page.get("CommonPrefixes", []):
                names.add(cp["Prefix"][len(base) :].rstrip("/"))
        return sorted(names)

    def delete_prefix(self, prefix: str) -> None:
        keys = [self._key(k) for k in self.list(prefix.rstrip("/") + "/")]
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            self._call(
                f"delete {prefix}",
                functools.partial(self.client.delete_objects, Bucket=self.bucket, Delete=batch),
            )

    def preflight(self) -> None:
        probe = self._key(f".preflight-{uuid.uuid4().hex[:12]}")
        try:
            self._call(
                "write a probe object",
                lambda: self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"ok"),
            )
            self._call(
                "delete a probe object",
                lambda: self.client.delete_object(Bucket=self.bucket, Key=probe),
            )
        except NotFound as exc:
            # S3 answers a write into a missing bucket with NoSuchBucket; a plain 404 to a
            # PUT means the endpoint is not S3 (a web server, a wrong path in the URL).
            raise self.error(
                f"{self.uri}: the endpoint {_where()} answered 404 Not Found to writing a "
                f"probe object ({exc}); it is not an S3 service, or its URL is wrong: check "
                f"{_endpoint_variable()} and the {self.subject}"
            ) from exc


def open_storage(
    uri: str, *, error: ErrorType = StorageError, subject: str = "storage root", **s3_options: Any
) -> Storage:
    """LocalStorage for a path (or file://path), S3Storage for s3://bucket/prefix.

    `s3_options` (retries, backoff_s, multipart_mb) go to S3Storage and are ignored for local
    roots."""
    if not uri or not str(uri).strip():
        raise error(f"{subject} is empty; give a directory or s3://bucket/prefix")
    uri = str(uri).strip()
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        return S3Storage(bucket, prefix, error=error, subject=subject, **s3_options)
    if uri.startswith("file://"):
        return LocalStorage(uri[len("file://") :], error=error, subject=subject)
    if "://" in uri:
        scheme = uri.split("://", 1)[0]
        raise error(
            f"{subject} {uri!r} uses unsupported scheme '{scheme}'; use a directory or s3://"
        )
    return LocalStorage(uri, error=error, subject=subject)
