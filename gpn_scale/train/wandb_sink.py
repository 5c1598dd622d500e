"""Weights & Biases: the sink a run logs to, and a reader of what an offline run wrote.

- `WandbSink(project, group, job_type, name, config, mode, dir, resume_id=None)`: `.run_id`;
  config is scrubbed again on the way in; mode "offline" | "online" | "disabled". Online, it
  says where it connects and gives up after `init_timeout` s (one ConfigError line).
- `wandb_server_reachable(timeout) -> (reachable, base_url)`: asked by logging.wandb.mode=auto.
- `read_offline_run(wandb_dir, run_id=None) -> OfflineRun(run_id, config, history, summary, ...)`:
  reads what an offline run wrote (its `.wandb` files), merging a run resumed in later processes.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpn_scale.core.config import ConfigError
from gpn_scale.train.secret_scrub import scrub_secrets

_WANDB_MODES = ("offline", "online", "disabled")
# Seconds wandb.init may wait for the server (W&B's own default is 90, with retries).
DEFAULT_INIT_TIMEOUT_S = 60.0


def wandb_server_reachable(timeout: float) -> tuple[bool, str]:
    """(reachable, base URL) of the W&B server: any HTTP answer counts as reachable.

    logging.wandb.mode=auto asks this before its one wandb.init: an online init that fails
    leaves the run id held by W&B's service process, so a second (offline) init of the same
    id can fail with "run ID is in use" (seen under load even after wandb.teardown()).
    """
    import urllib.error
    import urllib.request

    base_url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    try:
        urllib.request.urlopen(base_url, timeout=timeout)  # noqa: S310 - the configured server
    except urllib.error.HTTPError:
        return True, base_url
    except (OSError, ValueError):
        return False, base_url
    return True, base_url


class WandbSink:
    """A W&B run. With `resume_id` (from the checkpoint's meta) the same run is continued."""

    def __init__(
        self,
        project: str,
        group: str | None,
        job_type: str | None,
        name: str | None,
        config: dict[str, Any],
        mode: str,
        dir: str,
        resume_id: str | None = None,
        *,
        tags: list[str] | None = None,
        entity: str | None = None,
        settings: dict[str, Any] | None = None,
        init_timeout: float = DEFAULT_INIT_TIMEOUT_S,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if mode not in _WANDB_MODES:
            raise ConfigError(
                f"logging.wandb.mode={mode!r} is not one of {'/'.join(_WANDB_MODES)}; pick one"
            )
        import wandb

        Path(dir).mkdir(parents=True, exist_ok=True)
        # W&B's own default waits 90 s (and retries) for an unreachable server, silently:
        # say where it connects, and bound the wait with its init_timeout.
        base_url = os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url
        if mode == "online":
            (log or _stderr)(
                f"W&B: connecting to {base_url} (gives up after "
                f"logging.wandb.init_timeout={init_timeout:g} s; "
                "logging.wandb.mode=offline logs without a server)"
            )

        def init() -> Any:
            return wandb.init(
                project=project,
                entity=entity,
                group=group,
                job_type=job_type,
                name=name,
                tags=tags,
                config=scrub_secrets(config),
                mode=mode,  # type: ignore[arg-type]  # checked against wandb's modes above
                dir=str(dir),
                id=resume_id,
                resume="allow" if resume_id else None,
                reinit="create_new",  # several sinks (tests, eval after train) in one process
                # console="off": W&B must not wrap stdout/stderr (progress bars, one-line errors).
                settings=wandb.Settings(
                    console="off", silent=True, init_timeout=init_timeout, **(settings or {})
                ),
            )

        try:
            try:
                self._run = init()
            except Exception as exc:  # noqa: BLE001 - the one failure that a retry mends
                if not _inherited_service_is_gone(exc):
                    raise
                # W&B hands its service to child processes in WANDB_SERVICE; a process started
                # by one whose service has ended (a launcher that used W&B, a test runner)
                # cannot connect to it. This process starts its own instead.
                os.environ.pop(WANDB_SERVICE_ENV, None)
                (log or _stderr)(
                    f"W&B: the service named by the inherited {WANDB_SERVICE_ENV} does not "
                    "answer; starting this process's own"
                )
                self._run = init()
        except Exception as exc:  # noqa: BLE001 - surface as one line before training starts
            raise ConfigError(_init_failure(exc, mode, base_url, init_timeout)) from exc
        self._warned = False

    @property
    def run_id(self) -> str:
        return str(self._run.id)

    @property
    def dir(self) -> str:
        return str(self._run.dir)

    @property
    def offline(self) -> bool:
        return self._run.settings.mode == "offline"

    def log(self, metrics: dict[str, Any], step: int) -> None:
        try:
            self._run.log({str(k): _plain_wandb(v) for k, v in metrics.items()}, step=int(step))
        except Exception as exc:  # noqa: BLE001 - metrics must never stop training
            if not self._warned:
                warnings.warn(f"W&B log failed (further failures are silent): {exc}", stacklevel=2)
                self._warned = True

    def close(self) -> None:
        offline = self._run.settings.mode == "offline"
        sync_file = getattr(self._run.settings, "sync_file", None)
        try:
            self._run.finish()
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"W&B finish failed: {exc}", stacklevel=2)
            return
        if offline and sync_file:
            # finish() returns before W&B's core process has flushed the run file; wait for the
            # exit record so that "closed" means "on disk" (a resumed job or a reader follows).
            _wait_for_exit_record(Path(sync_file))


# Where W&B keeps the token of its service process for child processes to share.
WANDB_SERVICE_ENV = "WANDB_SERVICE"


def _inherited_service_is_gone(exc: BaseException) -> bool:
    """Whether wandb.init failed connecting to a service this process did not start."""
    return bool(os.environ.get(WANDB_SERVICE_ENV)) and (
        type(exc).__name__ == "WandbServiceConnectionError"
        or "Failed to connect to service" in str(exc)
    )


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _init_failure(exc: BaseException, mode: str, base_url: str, timeout: float) -> str:
    """One line for a failed wandb.init that names the setting to change."""
    # W&B's own hint names its Python API (wandb.Settings(init_timeout=...)), not our key.
    msg = " ".join(str(exc).split()).split(" Consider increasing the init_timeout")[0][:300]
    what = f"{type(exc).__name__}: {msg}"
    if "api key" in msg.lower():
        return (
            f"W&B init failed in mode {mode!r} ({what}); set WANDB_API_KEY (or run `wandb "
            "login`) or use logging.wandb.mode=offline"
        )
    if mode == "online" and ("timed out" in msg.lower() or "connect" in msg.lower()):
        return (
            f"W&B server {base_url} not reachable within logging.wandb.init_timeout="
            f"{timeout:g} s ({what}); use logging.wandb.mode=offline (upload later with "
            "`wandb sync`) or fix WANDB_BASE_URL / the network"
        )
    return f"W&B init failed in mode {mode!r} ({what}); use logging.wandb.mode=offline"


def _wait_for_exit_record(path: Path, timeout_s: float = 20.0) -> None:
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            records = _leveldb_records(path.read_bytes())
        except (OSError, ValueError):
            records = []
        for raw in reversed(records[-5:]):
            rec = pb.Record()  # type: ignore[attr-defined]  # generated protobuf module
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "exit":
                return
        time.sleep(0.05)
    warnings.warn(
        f"W&B offline file {path} has no exit record after {timeout_s:.0f}s", stacklevel=3
    )


def _plain_wandb(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


# -- reading offline runs -----------------------------------------------------------------------

# wandb 0.31 has no public reader for its `.wandb` transaction log (the old python DataStore
# moved into the Go core), and the file is what an offline run leaves, so this small reader
# exists for tests and for inspecting runs on air-gapped clusters. Format: a 7-byte header
# (":W&B", magic 0xBEE1, version), then LevelDB log framing - 32 KiB blocks of records with a
# 7-byte header (crc32c, little-endian length, type FULL/FIRST/MIDDLE/LAST) - around serialised
# `wandb_internal_pb2.Record` protobufs. Checksums are not verified; a torn tail is ignored.
_HEADER_LEN = 7
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _leveldb_records(data: bytes) -> list[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B transaction log (missing ':W&B' header)")
    out: list[bytes] = []
    pos, pending = _HEADER_LEN, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding up to the block end
            pos += left
            continue
        body = data[pos + 7 : pos + 7 + length]
        if len(body) < length:
            break  # torn tail
        pos += 7 + length
        if kind == _FULL:
            out.append(body)
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            out.append(pending + body)
            pending = b""
    return out


@dataclass
class OfflineRun:
    run_id: str
    config: dict[str, Any]
    history: list[dict[str, Any]]
    summary: dict[str, Any]
    project: str | None = None
    entity: str | None = None
    group: str | None = None
    job_type: str | None = None
    name: str | None = None
    files: list[str] = field(default_factory=list)


def _item_key(item: Any) -> str:
    return item.key if item.key else ".".join(item.nested_key)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def read_offline_run(wandb_dir: str | os.PathLike[str], run_id: str | None = None) -> OfflineRun:
    """Config, per-step history and summary of an offline run found under `wandb_dir`.

    `wandb_dir` may be the `dir` given to W&B or its `wandb/` sub-directory. All `.wandb` files of
    the run (the first process and every resumed one) are read in the order they were started.
    `run_id` may be omitted when only one run is there (else the most recently started one).
    """
    from wandb.proto import wandb_internal_pb2 as pb

    # Skip W&B's "latest-run" symlink so that no file is read twice.
    found = [p for p in Path(wandb_dir).rglob("run-*.wandb") if p.parent.name != "latest-run"]
    files = sorted(found, key=lambda p: (p.parent.name.split("-", 2)[-1], p.stat().st_mtime_ns))
    if not files:
        raise FileNotFoundError(f"no W&B run files (run-*.wandb) under {wandb_dir}")
    if run_id is None:
        run_id = files[-1].stem[len("run-") :]
    files = [p for p in files if p.stem == f"run-{run_id}"]
    if not files:
        raise FileNotFoundError(f"no W&B files for run {run_id} under {wandb_dir}")
    run = OfflineRun(
        run_id=run_id, config={}, history=[], summary={}, files=[str(p) for p in files]
    )
    for path in files:
        for raw in _leveldb_records(path.read_bytes()):
            rec = pb.Record()  # type: ignore[attr-defined]  # generated protobuf module
            rec.ParseFromString(raw)
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                r = rec.run
                run.project = r.project or run.project
                run.entity = r.entity or run.entity
                run.group = r.run_group or run.group
                run.job_type = r.job_type or run.job_type
                run.name = r.display_name or run.name
                for item in r.config.update:
                    run.config[_item_key(item)] = _json(item.value_json)
            elif kind == "config":
                for item in rec.config.update:
                    run.config[_item_key(item)] = _json(item.value_json)
                for item in rec.config.remove:
                    run.config.pop(_item_key(item), None)
            elif kind == "history":
                row: dict[str, Any] = {}
                for item in rec.history.item:
                    which = item.WhichOneof("value")
                    if which is None:
                        value: Any = _json(item.value_json)
                    elif which == "none":
                        value = None
                    elif which == "json":
                        value = _json(item.json)
                    else:
                        value = getattr(item, which)
                    row[_item_key(item)] = value
                run.history.append(row)
            elif kind == "summary":
                for item in rec.summary.update:
                    run.summary[_item_key(item)] = _json(item.value_json)
                for item in rec.summary.remove:
                    run.summary.pop(_item_key(item), None)
    run.config.pop("_wandb", None)
    run.summary = {k: v for k, v in run.summary.items() if not k.startswith("_wandb")}
    return run
