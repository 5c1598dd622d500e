"""The S3 environment: the endpoint in effect (its userinfo masked wherever it is said), the
numbers the environment sets, and the boto3 client made from the endpoint and credentials."""

from __future__ import annotations

import os
import re
from typing import Any

from gpn_scale.io.storage.base import ErrorType, StorageError

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
    """The S3 endpoint URL in effect (see the package docstring), or None for AWS."""
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


def endpoint_in_words() -> str:
    """The endpoint in effect as messages name it (its userinfo masked)."""
    setting = endpoint_setting()
    return f"endpoint {redact_urls(setting[1])}" if setting else "the AWS default endpoint"


def endpoint_variable() -> str:
    """The variable that sets the endpoint, for a message's fix (S3_ENDPOINT_URL if none)."""
    setting = endpoint_setting()
    return setting[0] if setting else "S3_ENDPOINT_URL"


def env_number(name: str, default: float, error: ErrorType = StorageError) -> float:
    """The number variable `name` sets, `default` when unset or blank, else `error`."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise error(f"{name}={raw!r} is not a number; unset it or give a number") from None


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
