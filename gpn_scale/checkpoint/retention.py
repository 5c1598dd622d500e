"""Keep-last-K retention, pure: which step directories a committed save deletes."""

from __future__ import annotations

from gpn_scale.checkpoint.catalog import step_of


def to_delete(names: list[str], complete: list[str], current: str, keep_last: int) -> list[str]:
    """Of `names` (the step directories, newest first), those to delete once `current` is
    committed: the newest `keep_last` complete ones (`complete`, newest first) and `current`
    are kept, and so is every directory of a step at or after `current`'s (newer ones are
    another save's: left alone); older complete ones and abandoned partial ones go."""
    cur_step = step_of(current)
    keep = set(complete[:keep_last]) | {current}
    return [n for n in names if n not in keep and step_of(n) < cur_step]
