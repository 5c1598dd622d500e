"""The one error type of the checkpoint package."""

from __future__ import annotations

from gpn_scale.core.config import ConfigError
from gpn_scale.io.storage import one_line

__all__ = ["CheckpointError", "one_line"]


class CheckpointError(ConfigError):
    """A checkpoint cannot be written, found or loaded.

    The message is one line naming the problem and the fix, so a launcher can print it as is.
    It subclasses ConfigError because most causes are configuration (a bad path, missing
    credentials, a wrong resume URI) and the CLI already turns ConfigError into a clean exit.
    """

    def __init__(self, message: str) -> None:
        # Keep the promise of one line even when a wrapped library error is multi-line.
        super().__init__(" ".join(str(message).split()))
