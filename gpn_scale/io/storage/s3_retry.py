"""The one retry loop of every S3 request: a bounded exponential backoff on transient
failures (`RetryPolicy`), the line that says requests succeed only after retrying
(`RETRY_LOG`), and `call`, which runs a request under both."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from gpn_scale.io.storage.base import ErrorType, StorageError
from gpn_scale.io.storage.s3_env import endpoint_in_words, env_number, redact_urls
from gpn_scale.io.storage.s3_errors import RETRIED, Conflict, NotFound, classify, describe

T = TypeVar("T")


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
            f"request{'s' if requests != 1 else ''}{since} at {endpoint_in_words()} "
            f"(latest: {what} {url}: {redact_urls(detail)}); the run goes on, slower while S3 "
            "answers so "
            "(GPN_S3_RETRIES bounds the attempts per request)"
        )


RETRY_LOG = RetryLog()


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
