"""The sinks a run writes its metrics to, opened on rank 0: the resolved config beside
them, a JSONL history, and W&B when configured (online, offline, or auto: offline where
the server cannot be reached).

Durable: config.yaml is written whole (temp file, fsync, rename) and the history is fsynced
at each checkpoint (`sync_sinks`), so a crash never leaves a checkpoint whose config and
history are gone; what the history's repair on resume finds is logged in one line each."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpn_scale.core.config import ConfigError
from gpn_scale.io.run_folder import METRICS, RUN_CONFIG
from gpn_scale.io.storage import LocalStorage
from gpn_scale.run.config import TrainConfig, relocatable, to_yaml
from gpn_scale.train.metrics import JsonlSink
from gpn_scale.train.secret_scrub import scrub_secrets
from gpn_scale.train.wandb_sink import WandbSink


def open_sinks(
    cfg: TrainConfig,
    run_dir: str,
    resume_step: int | None,
    wandb_id: str | None,
    model_cfg: Any,
    n_params: int,
    log: Callable[[str], None],
) -> tuple[list[Any], str | None]:
    """(the sinks, the W&B run id the next checkpoints record). Call on rank 0 only."""
    path = Path(run_dir)
    # Resolved (defaults filled in, the derived paths written out) and relocatable: paths
    # inside the run folder relative to it, so a copied folder reads its own files.
    folder = LocalStorage(path, error=ConfigError, subject="run_dir")
    folder.put_bytes(RUN_CONFIG, to_yaml(relocatable(cfg)).encode())  # atomic, fsynced
    history = JsonlSink(str(path / METRICS), resume_step=resume_step)
    for note in history.notes:
        log(f"metrics: {note}")
    sinks: list[Any] = [history]
    if cfg.logging.wandb.mode != "disabled":
        config = scrub_secrets(
            {**cfg.to_dict(), "model_config": model_cfg.to_dict(), "params": n_params}
        )
        try:
            sink = _open_wandb(cfg, path, config, wandb_id, log)
        except BaseException:
            sinks[0].close()  # the metrics file is flushed and closed before the run's cleanup
            raise
        wandb_id = sink.run_id
        sinks.append(sink)
    return sinks, wandb_id


def sync_sinks(sinks: list[Any]) -> None:
    """Put what the sinks hold on disk (the JSONL history; W&B keeps its own files)."""
    for sink in sinks:
        sync = getattr(sink, "sync", None)
        if sync is not None:
            sync()


def _open_wandb(
    cfg: TrainConfig,
    run_dir: Path,
    config: dict[str, Any],
    wandb_id: str | None,
    log: Callable[[str], None],
) -> WandbSink:
    wb = cfg.logging.wandb

    def open_wandb(mode: str) -> WandbSink:
        return WandbSink(
            project=wb.project,
            entity=wb.entity,
            group=wb.group,
            job_type=wb.job_type,
            name=cfg.run_name,
            config=config,
            mode=mode,
            dir=wb.dir or str(run_dir),
            resume_id=wandb_id or wb.run_id,
            init_timeout=wb.init_timeout,
            log=log,
        )

    mode = wb.mode
    if mode == "auto":
        from gpn_scale.train.wandb_sink import wandb_server_reachable

        reachable, base_url = wandb_server_reachable(min(wb.init_timeout, 10.0))
        mode = "online" if reachable else "offline"
        if not reachable:  # compute nodes often have no internet
            log(f"W&B: {base_url} not reachable; logging.wandb.mode=auto: offline instead")
    try:
        sink = open_wandb(mode)
    except ConfigError as err:
        if wb.mode != "auto" or mode != "online":
            raise
        # compute nodes often have no internet: log offline, upload from a login node
        log(f"W&B: online failed ({err}); logging.wandb.mode=auto: offline instead")
        import wandb

        wandb.teardown()  # else the failed online attempt still holds the run id
        sink = open_wandb("offline")
    if sink.offline:
        log(
            f"W&B: offline run {sink.run_id} in {sink.dir}; upload it with "
            f"`wandb sync {Path(sink.dir).parent}`"
        )
    return sink
