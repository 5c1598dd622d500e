"""S3 failures: classified once (what kind of failure, and whether retrying can cure it),
then said in one line naming the problem and the fix."""

from __future__ import annotations

from gpn_scale.io.storage.base import is_s3, one_line, split_s3
from gpn_scale.io.storage.s3_env import endpoint_in_words, endpoint_variable, redact_urls

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
    where = endpoint_in_words()
    var = endpoint_variable()
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
