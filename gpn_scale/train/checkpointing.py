"""A run's checkpoints as the trainer uses them: where it starts (resume, a finished run, a
warm start), the run's lease, and each save and restore with the position and the data
identity it records."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from torch import nn

from gpn_scale.checkpoint.async_save import AsyncSaver
from gpn_scale.checkpoint.rng import capture_rng_state, restore_rng_state
from gpn_scale.core.config import ConfigError
from gpn_scale.io.run_folder import FINAL_WEIGHTS, record_run_dir, resolve_recorded
from gpn_scale.parallel.topology import Topology
from gpn_scale.parallel.train_module import TrainModule
from gpn_scale.run.config import TrainConfig, relocatable
from gpn_scale.run.sources import (
    describe_tokenizer,
    open_source,
    read_weights,
    root_of,
    same_tokenizer,
    tokenizer_record,
)
from gpn_scale.train.preflight import (
    DONE_MARKER,
    check_model_compatible,
    finished_at,
    last_ckpt_step,
)
from gpn_scale.train.state import RunResult, TrainingError, TrainState

# Settings whose change on resume alters the run that was checkpointed (the schedule or
# the optimiser); allowed (e.g. extending total_steps), but never silently.
RESUME_WATCHED = ("schedule", "optim")


class RunCheckpoints:
    """The run's checkpoint root (`mgr`), seen from one rank of the trainer."""

    def __init__(
        self,
        cfg: TrainConfig,
        topo: Topology,
        mgr: Any,
        log: Callable[[str], None],
        *,
        strategy: str,
        run_dir: str,
        resume: str,
        eval_only: bool,
        fresh: bool,
        take_over: bool,
    ) -> None:
        self.cfg, self.topo, self.mgr, self.log = cfg, topo, mgr, log
        self.run_dir, self.resume, self.eval_only = run_dir, resume, eval_only
        self.fresh, self.take_over = fresh, take_over
        self.strategy = strategy  # resolved: none | fsdp2 | deepspeed
        self.lease: Any = None
        self.initial_load_uri: str | None = None  # the weights step 0 started from
        # The data's identity, recorded with every checkpoint (set by record_data).
        self.tokenizer_identity: dict[str, Any] | None = None
        self.files: dict[str, bytes] = {}  # carried in each step directory
        self.data_fingerprint: str | None = None
        self.remote: str | None = None
        # checkpoint.async_mode: saves written, uploaded and committed in the background.
        self.saver: AsyncSaver | None = None
        if cfg.checkpoint.async_mode != "off" and not eval_only:
            self.saver = AsyncSaver(mgr, cfg.checkpoint.async_mode, log)

    # ------------------------------------------------------------------ where to start
    def start_points(self, model_cfg: Any) -> tuple[str | None, Any]:
        """(the checkpoint to resume, the warm-start source): checked before anything is
        written; an eval with nothing to evaluate is refused here."""
        cfg, mgr = self.cfg, self.mgr
        resume_uri = mgr.resolve_resume(self.resume) if self.resume != "none" else None
        auto = self.resume == "auto"
        if auto and resume_uri is None and not self.eval_only:
            mgr.refuse_start_over()  # damaged checkpoints are never started over in silence
        for uri, reason in mgr.skipped if auto else ():
            self.log(f"resume auto: skipped {uri} (step {last_ckpt_step(uri)}): {reason}")
        if auto and mgr.note:
            self.log(f"resume auto: {mgr.note}")
        warm = None
        if cfg.checkpoint.initial_load and not self.eval_only:
            if resume_uri:
                self.log(
                    f"checkpoint.initial_load: ignored, the run resumes its own checkpoint "
                    f"{resume_uri}"
                )
            else:
                warm = self._initial_load_source(model_cfg)
        if self.eval_only and resume_uri is None and not no_resume(self.resume):
            raise ConfigError(
                f"eval: no complete checkpoint under {mgr.root} to evaluate; "
                "pass --checkpoint URI, the run's run_dir / checkpoint.root, or "
                "--checkpoint none for the untrained model"
            )
        return resume_uri, warm

    def check_existing_run(self, resume_uri: str | None) -> RunResult | None:
        """Refuse to start over existing checkpoints without --fresh; a finished run is
        left as it is (a RunResult: nothing to do). None: go on."""
        mgr = self.mgr
        raw = mgr.storage.get_bytes(DONE_MARKER)
        try:
            done = json.loads(raw) if raw else None
        except ValueError:
            done = {}
        if no_resume(self.resume):
            if self.fresh:
                return None
            ckpts = mgr.list_checkpoints()
            if ckpts or done is not None:
                what = (
                    f"checkpoints (newest step {ckpts[0][0]})"
                    if ckpts
                    else "a DONE marker (a finished run)"
                )
                raise ConfigError(
                    f"checkpoint.root {mgr.root} already holds {what}; "
                    "--resume auto continues that run, --fresh deletes it and "
                    "starts over, or choose another run_dir / checkpoint.root"
                )
            return None
        if done is None:
            return None
        done_step = int(done.get("step", 0) or 0)
        total = self.cfg.schedule.total_steps
        if finished_at(done, resume_uri, total) is not None:
            msg = (
                f"run already finished at step {done_step} ({mgr.storage.child_uri(DONE_MARKER)}); "
                "nothing to do: raise schedule.total_steps to train further, or --fresh "
                "to start over"
            )
            self.log(msg)
            return RunResult(
                0,
                done_step,
                int(done.get("tokens", 0) or 0),
                self.run_dir,
                resolve_recorded(done.get("checkpoint"), mgr.storage.uri) or resume_uri,
                message=msg,
            )
        if resume_uri is None:
            raise ConfigError(
                f"{mgr.storage.child_uri(DONE_MARKER)} says the run finished at "
                f"step {done_step} but no checkpoint is left to continue it to "
                f"schedule.total_steps={total}; --fresh starts over"
            )
        return None

    def take_lease(self) -> None:
        """Rank 0 takes the run's lease before anything is written; every rank agrees."""
        if not self.cfg.checkpoint.lease_ttl_s:
            return
        from gpn_scale.checkpoint.lease import LeaseHeld, RunLease

        error = None
        if self.topo.is_main:
            lease = RunLease(self.mgr.storage, self.cfg.checkpoint.lease_ttl_s)
            try:
                note = lease.acquire(take_over=self.take_over)
                self.lease = lease
                if note:
                    self.log(note)
            except LeaseHeld as err:
                error = str(err)
        if self.topo.all_reduce_max(1.0 if error else 0.0) > 0:
            raise LeaseHeld(error or "another job holds this run's lease (see rank 0)")

    def wait_saved(self) -> None:
        """A background save in flight (checkpoint.async_mode), committed; its failure
        raises here in one line. Nothing to do for synchronous saves."""
        if self.saver is not None:
            self.saver.wait()

    def close(self) -> None:
        """At exit: a background save in flight is waited for (its failure said in one
        line: the run's own outcome stands), then the lease is released."""
        if self.saver is not None:
            failed = self.saver.close()
            if failed:
                self.log(f"checkpoint: {failed}")
        self.release_lease()

    def release_lease(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def lease_lost(self, now: bool = False) -> str | None:
        """Rank 0: the line saying another job took the run over, else None (other ranks:
        None). `now` reads the lease (before a checkpoint write); else the heartbeat thread's
        last look (each step: no I/O)."""
        if self.lease is None:
            return None
        try:
            return self.lease.check() if now else self.lease.lost
        except Exception:  # noqa: BLE001 - unreadable now: the heartbeat thread keeps looking
            return self.lease.lost

    def run_in_use(self) -> bool:
        """Whether another job holds the run's lease now: a failed start then removes none
        of the folders it found missing (they may be that job's by now). If not, our own
        lease is released first (its heartbeat would put it back into a removed folder)."""
        from gpn_scale.checkpoint.lease import held_by_another

        if held_by_another(self.mgr.storage, self.lease):
            return True
        self.release_lease()
        return False

    def discard_previous_run(self) -> None:
        """--fresh: delete the earlier run's checkpoints and DONE (rank 0), then agree."""
        mgr = self.mgr
        if self.topo.is_main:
            gone = mgr.delete_all()
            mgr.storage.delete(DONE_MARKER)
            if gone:
                self.log(f"--fresh: deleted {len(gone)} checkpoint(s) and DONE under {mgr.root}")
        self.topo.barrier()

    def write_done(self, done: dict[str, Any]) -> None:
        """The DONE marker (rank 0): sweeps skip runs that have it. Only once the last
        checkpoint has committed (a background save is waited for)."""
        self.wait_saved()
        if self.topo.is_main:
            self.mgr.storage.put_bytes(DONE_MARKER, json.dumps(done, indent=1).encode())
        self.topo.barrier()

    # ------------------------------------------------------------------ the data's identity
    def record_data(self, tokenizer: dict[str, Any], fingerprint: str | None, remote: str) -> None:
        """Saved with every checkpoint: eval and generation find the tokenizer without the
        training data (run/sources.py)."""
        self.tokenizer_identity, self.files = tokenizer_record(tokenizer)
        self.data_fingerprint, self.remote = fingerprint, remote

    def check_same_data(self, meta: dict, uri: str) -> None:
        """A checkpoint read with data tokenized otherwise is refused (its ids would mean
        other text); held-out eval on another dataset of the same tokenizer says so."""
        recorded, ours = meta.get("tokenizer"), self.tokenizer_identity
        if isinstance(recorded, dict) and ours and not same_tokenizer(recorded, ours):
            raise ConfigError(
                f"data.remote {self.remote} is tokenized with {describe_tokenizer(ours)}, but "
                f"checkpoint {uri} was trained with {describe_tokenizer(recorded)}; point "
                "data.remote at data built with the checkpoint's tokenizer"
            )
        saved = (meta.get("loader") or {}).get("dataset")
        fingerprint = self.data_fingerprint
        if self.eval_only and saved and fingerprint and saved != fingerprint:
            self.log(
                f"eval: warning: data.remote {self.remote} is not the dataset {uri} was "
                f"trained on (fingerprint {fingerprint} != {saved}); evaluating on it"
            )

    # ------------------------------------------------------------------ save / restore
    def save(
        self, train_module: TrainModule, state: TrainState, loader: Any, model_cfg: Any
    ) -> str:
        finite = 0.0 if train_module.weights_finite() else 1.0
        lost = self.lease_lost(now=True)  # one writer per run: read the lease before writing
        flag = self.topo.all_reduce_max(2.0 if lost else finite)
        if flag >= 2:
            from gpn_scale.checkpoint.lease import LOST_ON_RANK_0, LeaseLost

            raise LeaseLost(lost or LOST_ON_RANK_0)
        if flag > 0:
            raise TrainingError(
                f"refusing to checkpoint at step {state.step}: the weights are not "
                "finite; the previous checkpoint is kept"
            )
        meta = {
            "step": state.step,
            "tokens": state.tokens,
            "skipped_steps": state.skipped,
            "loader": loader.state_dict(),
            "wandb_run_id": state.wandb_id,
            "world_size": self.topo.world_size,
            "backend": self.strategy,
            "model_config": model_cfg.to_dict(),
            "config": relocatable(self.cfg).to_dict(),
            # The run folder relative to the checkpoint root (or absolute): eval finds the
            # run's own data beside a copied or moved checkpoint (io/run_folder.py).
            "run_dir": record_run_dir(self.run_dir, self.mgr.root),
            "tokenizer": self.tokenizer_identity,
            "initial_load": self.initial_load_uri,
        }
        rank_state = {"rng": capture_rng_state(), "loader": loader.state_dict()}
        if self.saver is None:
            uri = train_module.save(self.mgr, state.step, meta, rank_state, self.files)
            self.log(f"step {state.step}: checkpoint {uri}")
            return uri
        # The train module hands its state dict to the saver's save (the manager's signature):
        # staged to CPU now, written, uploaded and committed in the background.
        uri = train_module.save(self.saver, state.step, meta, rank_state, self.files)
        self.log(
            f"step {state.step}: checkpoint {uri} (writing in the background; training "
            f"waited {self.saver.blocking_s:.3f}s)"
        )
        return uri

    def restore(
        self, uri: str | None, train_module: TrainModule, loader: Any, model_cfg: Any
    ) -> TrainState:
        """The position of `uri` (None: a fresh start), its weights and optimizer loaded;
        `eval --checkpoint auto` takes the newest complete checkpoint at this moment."""
        if self.resume == "auto" and uri is None and not self.eval_only:
            self.log(f"resume auto: no complete checkpoint under {self.mgr.root}; starting fresh")
        if uri is None:
            return TrainState()
        if self.eval_only and self.resume == "auto":
            return self._restore_newest(uri, train_module, loader, model_cfg)
        if self.resume == "auto":  # a damaged checkpoint falls back to the one before it
            return self.mgr.load_newest(
                uri, lambda u: self._restore(u, train_module, loader, model_cfg), self.log
            )
        return self._restore(uri, train_module, loader, model_cfg)

    def _restore(
        self, uri: str, train_module: TrainModule, loader: Any, model_cfg: Any
    ) -> TrainState:
        # Check the model shape from the manifest before DCP tries (and fails less clearly).
        # From the manifest wherever it is (an explicit --resume URI may be another run's).
        check_model_compatible(self.mgr.read_meta(uri).get("model_config"), model_cfg, uri)
        ck = train_module.load(self.mgr, uri)
        meta = ck.meta
        check_model_compatible(meta.get("model_config"), model_cfg, uri)
        rank_state = ck.rank_state
        if self.eval_only:  # the training position is not needed (nor another dataset's)
            self.log(f"eval: loaded {uri} (step {meta['step']}, {meta['tokens']:,} tokens)")
        else:
            if rank_state:
                restore_rng_state(rank_state["rng"])
                loader.load_state_dict(rank_state["loader"])
            else:  # another world size: streaming's global position is valid for any world
                loader.load_state_dict(meta["loader"])
            self.log(f"resumed from {uri} at step {meta['step']} ({meta['tokens']:,} tokens)")
            for line in changed_settings(meta.get("config"), self.cfg.to_dict()):
                self.log(f"warning: resuming with a changed setting: {line}")
        return TrainState(
            step=int(meta["step"]),
            tokens=int(meta["tokens"]),
            skipped=int(meta.get("skipped_steps", 0)),
            wandb_id=meta.get("wandb_run_id"),
            last_ckpt=uri,
        )

    def _restore_newest(
        self, uri: str, train_module: TrainModule, loader: Any, model_cfg: Any
    ) -> TrainState:
        """`eval --checkpoint auto` beside a live run: the newest complete checkpoint now
        (the run may have saved since the start), loaded whole before anything uses it; if
        the run's retention deletes it meanwhile, the newest one then (a few tries)."""
        from gpn_scale.checkpoint import CheckpointError

        for attempt in range(4):
            uri = self.mgr.latest() or uri
            try:
                return self._restore(uri, train_module, loader, model_cfg)
            except CheckpointError:
                if attempt == 3 or self.mgr.is_complete(uri):
                    raise
                self.log(f"eval: {uri} was deleted while loading (retention); trying the newest")
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ warm start
    def _initial_load_source(self, model_cfg: Any) -> Any:
        """The checkpoint `checkpoint.initial_load` names, checked against this run's model
        (family and shape) from its manifest or config, before any tensor is read."""
        ref = str(self.cfg.checkpoint.initial_load)
        try:
            source = open_source(ref)
        except ConfigError as err:
            raise ConfigError(f"checkpoint.initial_load: {err}") from None
        kind, uri = source.kind, source.uri
        saved = source.meta.get("model_config")
        if not isinstance(saved, dict):
            raise ConfigError(
                f"checkpoint.initial_load {uri}: no model config recorded with it (a "
                "model_final.pt needs its run's config.yaml beside it) to check against "
                f"model={self.cfg.model}; give a step directory or an export"
            )
        check_model_compatible(saved, model_cfg, uri, use="checkpoint.initial_load")
        strategy = self.strategy
        if not self.cfg.checkpoint.initial_load_model_only and (
            kind != "dcp" or strategy == "deepspeed"
        ):
            raise ConfigError(
                f"checkpoint.initial_load_model_only=false: the optimizer state is read from a "
                f"DCP step directory under parallel.backend none / fsdp2 ({uri} is a {kind} "
                f"checkpoint, backend {strategy}); set initial_load_model_only=true"
            )
        self.initial_load_uri = uri
        return source

    def load_initial_weights(
        self, model: nn.Module, source: Any, spec: Any, model_cfg: Any
    ) -> None:
        """Collective for a DCP source: every rank reads the full weights (DCP reassembles
        any dp/tp layout) into the unsharded model, which the train module then shards."""
        from gpn_scale.checkpoint import CheckpointError

        try:
            state = read_weights(source, model, spec, model_cfg)
        except CheckpointError as err:
            if "it is a deepspeed checkpoint" in str(err):
                raise ConfigError(
                    f"checkpoint.initial_load {source.uri} is a DeepSpeed checkpoint; give "
                    f"its run's {FINAL_WEIGHTS} (checkpoint.export_final) or a DCP checkpoint"
                ) from None
            raise
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ConfigError(
                f"checkpoint.initial_load {source.uri}: its weights do not fit model="
                f"{self.cfg.model} ({str(err).strip().splitlines()[0][:160]})"
            ) from None

    def load_initial_optimizer(self, train_module: TrainModule, source: Any) -> None:
        """initial_load_model_only=false: weights and optimizer from the DCP step directory
        (after the sharding), then the line that says what step 0 starts from."""
        model_only = self.cfg.checkpoint.initial_load_model_only
        if not model_only:
            from gpn_scale.checkpoint import CheckpointManager

            train_module.load(CheckpointManager(root_of(source.uri)), source.uri)
        what = "weights" + ("" if model_only else " and optimizer")
        fresh = (
            "fresh optimizer, schedule and data position"
            if model_only
            else "its optimizer state; fresh schedule and data position"
        )
        step_of = source.meta.get("step")
        self.log(
            f"checkpoint.initial_load: {what} of {source.uri}"
            + (f" (step {step_of})" if step_of is not None else "")
            + f"; starting at step 0 ({fresh})"
        )


def no_resume(resume: str) -> bool:
    """The spellings of --resume none (CheckpointManager.resolve_resume accepts the same)."""
    return resume.strip().lower() in ("none", "never", "no", "false", "off", "")


def changed_settings(saved: dict | None, current: dict) -> list[str]:
    """'key old -> new' for each watched setting a resume changes ([] without a saved config)."""
    if not isinstance(saved, dict):
        return []
    out = []
    for section in RESUME_WATCHED:
        old, new = saved.get(section) or {}, current.get(section) or {}
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                out.append(f"{section}.{key} {old.get(key)!r} -> {new.get(key)!r}")
    return out
