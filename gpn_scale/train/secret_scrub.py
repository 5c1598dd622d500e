"""Secret scrubbing: a copy of a config with its credentials replaced, made before the
config goes to W&B (the trainer's sinks scrub it, and WandbSink again on the way in).

- `is_secret_key(key)`: whether a config key names a credential (api_key, hf_token, password...).
- `looks_like_secret(value, key="")`: whether a string looks like one (known token formats,
  PEM keys; a 40-hex value under a sha/commit/hash key is not).
- `scrub_secrets(config) -> dict`: a deep copy with credential-looking keys/values replaced by
  `REDACTED`, and passwords inside URLs (scheme://user:pass@host) replaced in place.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***REDACTED***"

# Key words that name a credential on their own, or after a qualifier ("api_key", "hf_token").
# Plain "key"/"token" are not enough: model configs have d_key, vocab configs have eos_token.
_SECRET_WORDS = {
    "secret",
    "secrets",
    "password",
    "passwd",
    "pwd",
    "passphrase",
    "credential",
    "credentials",
    "apikey",
    "privatekey",
    "accesskey",
    "secretkey",
    "authtoken",
    "accesstoken",
    "bearer",
}
_QUALIFIERS = {
    "api",
    "access",
    "secret",
    "private",
    "auth",
    "session",
    "refresh",
    "bearer",
    "ssh",
    "signing",
    "encryption",
    "client",
    "wandb",
    "hf",
    "huggingface",
    "github",
    "gh",
    "aws",
    "openai",
    "slack",
    "s3",
    "gcs",
    "azure",
    "token",
    "id",
}
_SECRET_TAILS = {"key", "token", "keys", "tokens"}
_VALUE_PATTERNS = [
    re.compile(r"^(AKIA|ASIA)[0-9A-Z]{16}$"),  # AWS access key id
    re.compile(r"^hf_[A-Za-z0-9]{30,}$"),  # Hugging Face token
    re.compile(r"^(ghp|gho|ghu|ghs|ghr|github_pat)_[A-Za-z0-9_]{20,}$"),  # GitHub tokens
    re.compile(r"^sk-[A-Za-z0-9_-]{20,}$"),  # OpenAI-style secret keys
    re.compile(r"^xox[abposr]-[A-Za-z0-9-]{10,}$"),  # Slack tokens
    re.compile(r"^eyJ[A-Za-z0-9_-]+\.eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+$"),  # JWT
    re.compile(r"^(local-|wandb_v\d+_)?[0-9a-f]{40}$"),  # W&B API key (40 hex; see _HASHY_KEYS)
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),  # PEM private key
]
_URL_CREDENTIALS = re.compile(
    r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^/\s:@]+):(?P<pw>[^/\s@]+)@"
)
_HASHY_KEYS = re.compile(
    r"(sha|commit|hash|digest|rev|revision|checksum|etag|uuid|run_id|id)$", re.I
)


def _words(key: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key)  # camelCase -> camel_Case
    return [w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if w]


def is_secret_key(key: str) -> bool:
    """Whether a config key names a credential (api_key, hf_token, password,
    AWS_SECRET_ACCESS_KEY...)."""
    words = _words(str(key))
    if not words:
        return False
    if any(w in _SECRET_WORDS for w in words):
        return True
    if len(words) == 1:
        return words[0] in ("key", "token")  # a bare "tokens" is a count, not a credential
    if words[-1] == "id" and len(words) >= 3:  # aws_access_key_id, but not client_id / run_id
        words = words[:-1]
    return words[-1] in _SECRET_TAILS and words[-2] in _QUALIFIERS


def looks_like_secret(value: str, key: str = "") -> bool:
    """Whether a string value looks like a credential (known token formats, PEM keys)."""
    text = value.strip()
    for pattern in _VALUE_PATTERNS:
        if pattern.search(text):
            if pattern.pattern.startswith("^(local-") and _HASHY_KEYS.search(
                _words(key)[-1] if _words(key) else ""
            ):
                return False  # a git commit or content hash, not an API key
            return True
    return False


def scrub_secrets(config: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy of `config` with secrets replaced by '***REDACTED***'.

    A value is replaced when its key names a credential (words like secret/password/credentials,
    or key/token after a qualifier: api_key, hf_token, aws_secret_access_key; bare key/token too),
    or when a string looks like one (AWS key ids, hf_/ghp_/sk- tokens, JWTs, 40-hex W&B keys
    unless the key says sha/commit/hash, PEM private keys). Passwords inside URLs
    (scheme://user:pass@host) are replaced in place. Non-string containers are walked.
    """

    def walk(value: Any, key: str) -> Any:
        if isinstance(value, Mapping):
            return {
                k: (
                    REDACTED
                    if is_secret_key(str(k)) and v not in (None, "", {}, [])
                    else walk(v, str(k))
                )
                for k, v in value.items()
            }
        if isinstance(value, (list, tuple)):
            return [walk(v, key) for v in value]
        if isinstance(value, str):
            if looks_like_secret(value, key):
                return REDACTED
            return _URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", value)
        return value

    return walk(dict(config), "")
