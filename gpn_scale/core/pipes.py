"""Ending a command quietly when the reader of its output has gone (`… | head`).

Without this, the first print after `head` exits raises BrokenPipeError, and the
interpreter's final flush of stdout raises it again: a traceback after output the user
asked to cut short.
"""

from __future__ import annotations

import os
import sys

# 128 + SIGPIPE: what a shell reports for a command whose reader closed the pipe early.
EXIT_BROKEN_PIPE = 141


def quiet_broken_pipe() -> int:
    """Point stdout at /dev/null so that the final flush does not raise again (Python's own
    advice for SIGPIPE), and return the exit status to end with."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE
