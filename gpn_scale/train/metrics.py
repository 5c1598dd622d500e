"""Metrics sinks: the protocol and the JSONL file every run writes (W&B's sink:
gpn_scale.train.wandb_sink; the secret scrubbing of logged configs: gpn_scale.train.secret_scrub).

API (the training loop creates these on rank 0 only)::

    sink = JsonlSink(run_dir / "metrics.jsonl", resume_step=step_or_None)
    sink.log({"loss": 2.3, "lr": 1e-3}, step=10); sink.close()

- `MetricsSink` (Protocol): `log(metrics: dict, step: int) -> None`, `close() -> None`.
- `JsonlSink(path, resume_step=None)`: one JSON object per line,
  `{"step": s, ...metrics, "time": t}`; appends; with resume_step it first drops lines with
  step > resume_step (the steps a preempted job did after its last checkpoint and will redo),
  so the per-step history stays clean. A torn last line (killed mid-write) is dropped too, and
  a history that ends before resume_step (lost with the disk's cache in a crash) is named:
  `notes` holds one line for each, for the trainer to log. `sync()` puts the rows on disk
  (the trainer calls it at each checkpoint). A write that fails (disk full, read-only) is a
  ConfigError of one line naming the file, the cause and the fix.
  Non-finite floats are written as the strings "NaN" / "Infinity" / "-Infinity" so every JSON
  reader accepts the file.
- `read_jsonl(path, live=False)`: the rows of such a file (tests, plots, reports, sweep status).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from gpn_scale.core.config import ConfigError
from gpn_scale.io.storage import fsync_dir, os_error_line


@runtime_checkable
class MetricsSink(Protocol):
    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def _plain(value: Any) -> Any:
    """A JSON-friendly python value: tensors/numpy scalars -> python, non-finite -> string."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


# -- JSONL --------------------------------------------------------------------------------------


class JsonlSink:
    """Append-only JSONL metrics file (rank 0 only; a local path)."""

    def __init__(self, path: str | os.PathLike[str], resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.notes: list[str] = []  # what the repair found, one line each
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._repair(resume_step)
            self._file = open(self.path, "a", encoding="utf-8")
            fsync_dir(self.path.parent)  # a new file's name survives a crash too
        except OSError as exc:
            raise self._error(exc) from exc

    def _error(self, exc: OSError) -> ConfigError:
        return ConfigError(os_error_line("write metrics file", self.path, exc, "run_dir"))

    def _repair(self, resume_step: int | None) -> None:
        """Drop a torn last line and, on resume, lines beyond the resumed step (atomic rewrite);
        name a history that ends before the resumed step."""
        raw = self.path.read_text(encoding="utf-8", errors="replace") if self.path.exists() else ""
        lines = raw.splitlines()
        keep: list[str] = []
        changed = bool(raw) and not raw.endswith("\n")
        last = 0  # the newest step the history holds
        for i, line in enumerate(lines):
            try:
                row = json.loads(line)
            except ValueError:
                if i == len(lines) - 1:  # a torn write from a killed process
                    changed = True
                    self.notes.append(f"{self.path}: dropped a torn last line (a cut write)")
                    continue
                keep.append(line)  # garbage in the middle is not ours to judge: leave it
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if resume_step is not None and isinstance(step, (int, float)) and step > resume_step:
                changed = True
                continue
            last = max(last, int(step)) if isinstance(step, (int, float)) else last
            keep.append(line)
        if resume_step and last < resume_step:
            self.notes.append(
                f"{self.path}: the history ends at step {last} but the run resumes at step "
                f"{resume_step}: the rows of steps {last + 1}-{resume_step} are missing (lost "
                "in a crash or written elsewhere); the run goes on from its checkpoint"
            )
        if changed:
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in keep))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": int(step), **{str(k): _plain(v) for k, v in metrics.items()}}
        row.setdefault("time", time.time())
        try:
            self._file.write(json.dumps(row, allow_nan=False) + "\n")
            self._file.flush()  # a killed job loses at most the line being written
        except OSError as exc:
            raise self._error(exc) from exc

    def sync(self) -> None:
        """The rows written so far on disk (flushed and fsynced): they survive a crash."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise self._error(exc) from exc

    def close(self) -> None:
        if not self._file.closed:
            try:
                self.sync()
            finally:
                self._file.close()


def read_jsonl(path: str | os.PathLike[str], *, live: bool = False) -> list[dict[str, Any]]:
    """All rows of a metrics.jsonl file (for tests, plots, reports and sweep status).

    `live=True` reads a file that a run may still be writing: no file yet is no rows, and a
    line that does not parse as a JSON object (a torn last line) is skipped instead of raising.
    """
    if live and not os.path.isfile(path):
        return []
    rows = []
    with open(path, encoding="utf-8", errors="replace" if live else "strict") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if not live:
                    raise
                continue
            if isinstance(row, dict) or not live:
                rows.append(row)
    return rows
