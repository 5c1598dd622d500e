"""The error types of the checkpoint package."""

from __future__ import annotations

from gpn_scale.core.config import ConfigError
from gpn_scale.io.storage import one_line

__all__ = ["CheckpointDamaged", "CheckpointError", "one_line"]


class CheckpointError(ConfigError):
    """A checkpoint cannot be written, found or loaded.

    The message is one line naming the problem and the fix, so a launcher can print it as is.
    It subclasses ConfigError because most causes are configuration (a bad path, missing
    credentials, a wrong resume URI) and the CLI already turns ConfigError into a clean exit.
    """

    def __init__(self, message: str) -> None:
        # Keep the promise of one line even when a wrapped library error is multi-line.
        super().__init__(" ".join(str(message).split()))


class CheckpointDamaged(CheckpointError):
    """The checkpoint's own files cannot be loaded: missing, not matching the manifest (size,
    sha256, step), or refused as unsafe pickles. Another checkpoint may well load, so
    `--resume auto` falls back on this one; anything else (storage down, another model's
    shapes) is a plain CheckpointError, which no older checkpoint would cure.

    `reason`: the damage alone, without the `cannot load <uri>:` and the fix around it."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = " ".join(str(message if reason is None else reason).split())
