"""The one error type of the data pipeline.

`DataError` subclasses the model's `ConfigError` so that `gpn-scale` (which catches
`ConfigError`) prints it as `gpn-scale: error: <message>` and exits 2. Every message is
one line that names the problem and the fix.
"""

from __future__ import annotations

from gpn_scale.core.config import ConfigError


class DataError(ConfigError):
    """Bad data, a bad path, or an unreachable store; one line naming the problem and the fix."""

    def __init__(self, message: str) -> None:
        # One line, always: a multi-line cause (e.g. a botocore message) is folded.
        super().__init__(" ".join(str(message).split()))
