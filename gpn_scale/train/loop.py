"""The training loop. Read `Trainer.run` and `Trainer._run` top to bottom: they are the recipe.

    setup:   topology (parallel/train_module.py) -> determinism/seed -> model config -> checkpoint
             root and where to start (checkpointing.py) -> data (run_data.py) -> model ->
             train module: TP, then FSDP2 or DeepSpeed, and the optimizer -> restore -> sinks
    step:    lr(step) -> train_step (step.py): accumulate micro-batches, global loss, clip,
             skip if non-finite else update -> after the step: metrics (the step callbacks'
             too: callbacks.py), [profile], [eval], [checkpoint], [preemption: save, exit 75]
    finish:  eval -> final checkpoint -> DONE marker

Everything that depends on the sharding strategy is behind `parallel.train_module.TrainModule`;
the loop never asks which one it has.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gpn_scale import optim as optim_lib
from gpn_scale.checkpoint.lease import LOST_ON_RANK_0, LeaseLost
from gpn_scale.core.config import ConfigError
from gpn_scale.core.env import detect
from gpn_scale.core.hardware import device_peak_flops as peak_flops  # MFU's denominator
from gpn_scale.io.run_folder import (
    FINAL_WEIGHTS,
    METRICS,
    RUN_CONFIG,
    missing_tops,
    record_run_dir,
)
from gpn_scale.parallel.topology import Topology
from gpn_scale.parallel.train_module import resolve_strategy, setup_topology
from gpn_scale.run.config import TrainConfig, batch_layout
from gpn_scale.train.build import build_model, training_flops_per_token
from gpn_scale.train.callbacks import StepCallback
from gpn_scale.train.checkpointing import RunCheckpoints
from gpn_scale.train.determinism import set_determinism
from gpn_scale.train.preflight import last_ckpt_step
from gpn_scale.train.profiling import open_profiler
from gpn_scale.train.progress import (
    FirstStepNotice,
    Throughput,
    memory_gb,
    progress_bar,
    progress_line,
)
from gpn_scale.train.run_data import endless_batches
from gpn_scale.train.signals import EXIT_NONFINITE, EXIT_PREEMPTED, StopConditions
from gpn_scale.train.sinks import sync_sinks
from gpn_scale.train.state import Components, RunResult, TrainState
from gpn_scale.train.step import StepResult, train_step


class Trainer:
    """resume: 'auto' | 'none' | a checkpoint URI. 'none' refuses a checkpoint root that
    already holds checkpoints or DONE unless fresh=True, which deletes them (and the run's
    metrics history) once the setup has succeeded, then starts at step 0. callbacks: run
    after every step, their metrics logged (callbacks.py; the live analyses are one)."""

    def __init__(
        self,
        cfg: TrainConfig,
        resume: str = "none",
        log: Callable[[str], None] | None = None,
        eval_only: bool = False,
        fresh: bool = False,
        take_over: bool = False,
        callbacks: Sequence[StepCallback] = (),
    ) -> None:
        self.cfg = cfg
        self.eval_only = eval_only  # `gpn-scale eval`: restore, evaluate, write nothing
        self.resume = resume
        self.fresh = fresh
        self.take_over = take_over  # replace another job's live lease on the run
        self.callbacks = tuple(callbacks)
        self.run_dir = cfg.resolved_run_dir
        self._log = log or (lambda msg: print(msg, flush=True))
        self._log_is_print = log is None
        # Set by the setup (run); the finally of run() cleans up whichever exist.
        self.topo: Topology | None = None
        self.strategy = ""  # resolved: none | fsdp2 | deepspeed
        self.bf16 = False
        self.ckpt: RunCheckpoints | None = None
        self._pbar: Any = None
        self._loaders: list[Any] = []  # streaming loaders, closed when the run ends
        self._sinks: list[Any] = []
        self._eval_cache: str | None = None
        # What a failed start must not leave behind: the directories and files it created.
        self._new_dirs: list[Path] = []
        self._new_files: list[Path] = []
        self._started = False  # the setup succeeded and the sinks are open
        self._stepped = False  # an optimizer step or checkpoint of this process happened
        self._stops = StopConditions.off()  # run() installs the run's

    def log(self, msg: str) -> None:
        if self.topo is None or self.topo.is_main:
            if self._pbar is not None and self._log_is_print:
                self._pbar.write(msg)  # above the progress bar, not through it
            else:
                self._log(msg)

    @property
    def _topo(self) -> Topology:
        assert self.topo is not None, "Trainer.run sets up the topology first"
        return self.topo

    @property
    def _ckpt(self) -> RunCheckpoints:
        assert self.ckpt is not None, "Trainer._setup opens the checkpoint root first"
        return self.ckpt

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        cfg = self.cfg
        self._new_dirs = missing_tops(
            [
                self.run_dir,
                str(Path(self.run_dir) / "data"),
                cfg.resolved_checkpoint_root,
                cfg.data.local_cache,
            ]
        )
        # Installed before the setup and kept through the final eval, save and DONE: a
        # preemption signal in any of those windows is acted on, never fatal.
        p = cfg.preemption
        self._stops = StopConditions(p.enabled, p.end_margin_s, p.requeue)
        try:
            env = detect()
            self.strategy = resolve_strategy(cfg.parallel.backend, env.distributed)
            self.topo = setup_topology(env, self.strategy, cfg.train.device, cfg.parallel.tp)
        except BaseException:
            self._stops.uninstall()
            raise
        try:
            result = self._run()
            if self.eval_only:
                self._remove_new_dirs()
            return result
        except ConfigError:
            # exit 2 before anything was trained (a bad setting, or bad data met by the first
            # batch): leave nothing that was not there before
            if not self._started or not self._stepped:
                self._close_writers()  # before the removal: a loader would refill its cache
                self._remove_new_dirs()
            raise
        finally:
            self._close()

    def _close_writers(self) -> None:
        """The sinks, then the loaders (whose download threads write into the cache)."""
        for closeable in [*self._sinks, *self._loaders]:
            with contextlib.suppress(Exception):
                closeable.close()

    def _close(self) -> None:
        if self._pbar is not None:
            self._pbar.close()
        self._close_writers()
        if self._eval_cache:
            import shutil

            shutil.rmtree(self._eval_cache, ignore_errors=True)
        if self.ckpt is not None:
            self.ckpt.close()  # a background save in flight first, then the lease
        self._stops.uninstall()
        self._topo.destroy()

    def _run(self) -> RunResult:
        built = self._setup()
        if isinstance(built, RunResult):  # a finished run: nothing to do
            return built
        c, state = built
        if self.eval_only:
            if state.last_ckpt is None:
                self.log("eval: --checkpoint none: evaluating the untrained model")
            result = self._evaluate(c, state)
            return RunResult(0, state.step, state.tokens, self.run_dir, state.last_ckpt, result)
        stopped = self._start_training(c, state)
        if stopped is not None:
            return stopped
        stopped = self._train(c, state)
        if stopped is not None:
            return stopped
        return self._finish(c, state)

    # ------------------------------------------------------------------ setup
    def _setup(self) -> tuple[Components, TrainState] | RunResult:
        from gpn_scale.checkpoint import CheckpointManager
        from gpn_scale.run.model import model_config as run_model_config
        from gpn_scale.train import preflight

        cfg, topo = self.cfg, self._topo
        device = topo.device
        precision = cfg.train.precision
        self.bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
        deterministic = set_determinism(cfg, device)
        if cfg.train.deterministic == "auto":
            self.log(
                "train.deterministic=auto: deterministic algorithms "
                + (
                    "on (CPU: exact resume)"
                    if deterministic
                    else f"off on {device.type} (faster kernels, no NaN-filled torch.empty; "
                    "train.deterministic=true forces them on)"
                )
            )
        micro, accum = batch_layout(cfg, topo.dp_size)
        model_cfg = run_model_config(cfg)  # errors name model_overrides.<key> / tbptt
        preflight.check_tensor_parallel(model_cfg, topo.tp_size)
        preflight.check_model_device(cfg, model_cfg, device.type)

        # Checkpoint storage first: a bad path or missing credentials fails before any work.
        if not self.eval_only:
            preflight.check_run_dir(self.run_dir)  # names run_dir, not the checkpoint root
        mgr = CheckpointManager(cfg.resolved_checkpoint_root, keep_last=cfg.checkpoint.keep_last)
        if not self.eval_only:  # eval only reads: a read-only run (or mount) evaluates
            self._new_dirs += missing_tops([mgr.staging_root])
            mgr.preflight()
        self.ckpt = ckpt = RunCheckpoints(
            cfg, topo, mgr, self.log, strategy=self.strategy, run_dir=self.run_dir,
            resume=self.resume, eval_only=self.eval_only, fresh=self.fresh,
            take_over=self.take_over,
        )  # fmt: skip
        resume_uri, warm = ckpt.start_points(model_cfg)
        if not self.eval_only:
            finished = ckpt.check_existing_run(resume_uri)
            if finished is not None:
                return finished
            ckpt.take_lease()
        if topo.is_main and not self.eval_only:
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
        topo.barrier()
        train_loader, val_loader, val_start = self._setup_data(model_cfg, micro, resume_uri, warm)
        train_module, n_params = build_model(
            cfg, model_cfg, topo, self.strategy, self.bf16, micro, accum, warm, ckpt, self.log
        )
        state = ckpt.restore(resume_uri, train_module, train_loader, model_cfg)
        c = Components(
            mgr, train_module, model_cfg, train_loader, val_loader, val_start,
            micro, accum, n_params, training_flops_per_token(model_cfg, cfg.data.seq_len),
        )  # fmt: skip
        return c, state

    def _setup_data(
        self, model_cfg: Any, micro: int, resume_uri: str | None, warm: Any
    ) -> tuple[Any, Any, dict]:
        """(train loader, val loader, the val loader's start: every eval restarts there),
        after the data is checked against the model and the checkpoints the run starts from."""
        from gpn_scale.train.preflight import check_data
        from gpn_scale.train.run_data import build_loader, data_remote

        cfg, topo, ckpt = self.cfg, self._topo, self._ckpt
        remote = data_remote(cfg, self.run_dir, topo)
        data_meta = check_data(
            cfg,
            remote,
            model_cfg.vocab_size,
            micro,
            topo.dp_size,
            evaluates=self.eval_only or cfg.eval.at_end or cfg.eval.every_steps > 0,
        )
        ckpt.record_data(data_meta.tokenizer, data_meta.fingerprint, remote)
        if resume_uri:  # before any loader streams: data of another tokenizer is refused
            ckpt.check_same_data(ckpt.mgr.read_meta(resume_uri), resume_uri)
        if warm is not None:
            ckpt.check_same_data(warm.meta, warm.uri)
        loaders = []
        for split, batch in (("train", micro), ("val", cfg.eval.batch_size or micro)):
            loader, batches = build_loader(
                cfg, topo, split, batch, remote, model_cfg.vocab_size, self._cache_dir()
            )
            self._loaders.append(loader)  # closed when the run ends (run's finally)
            loaders.append(batches)
        return loaders[0], loaders[1], loaders[1].state_dict()

    def _cache_dir(self) -> str:
        """data.local_cache when set (train.sbatch points it at node-local scratch: two nodes
        sharing one cache race on its shard files); else <run_dir>/data/cache for training,
        and for eval, which only reads the run, a temporary directory of its own (removed
        when the run object ends)."""
        if self.cfg.data.local_cache:
            return self.cfg.data.local_cache
        if not self.eval_only:
            return str(Path(self.run_dir) / "data" / "cache")
        if self._eval_cache is None:
            import tempfile

            self._eval_cache = tempfile.mkdtemp(prefix="gpn_eval_cache_")
        return self._eval_cache

    def _start_training(self, c: Components, state: TrainState) -> RunResult | None:
        """The last moment to stop without training; then the sinks open and the run starts."""
        cfg, topo = self.cfg, self._topo
        if cfg.debug.setup_sleep:
            self.log(f"debug: sleeping {cfg.debug.setup_sleep:g}s at the end of the setup")
            time.sleep(cfg.debug.setup_sleep)
        if self._stop_requested():  # Ctrl-C or a preemption signal during the setup
            return self._stopped_in_setup(state)
        if self.fresh:  # the explicit choice, acted on only now that the setup has worked
            self._ckpt.discard_previous_run()
        # A fresh start (step 0) drops the history of an earlier attempt that left no
        # checkpoint, as a resume drops the steps after its checkpoint: one history per run.
        run_path = Path(self.run_dir)
        self._new_files = [p for p in (run_path / RUN_CONFIG, run_path / METRICS) if not p.exists()]
        if topo.is_main:
            from gpn_scale.train.sinks import open_sinks

            self._sinks, state.wandb_id = open_sinks(
                cfg, self.run_dir, state.step, state.wandb_id, c.model_cfg, c.n_params, self.log
            )
        self._started = True
        self._stepped = False
        self._stops.training_started()
        self.log(
            f"train: {c.model_cfg.name or cfg.model} ({c.n_params:,} params), backend "
            f"{self.strategy}, world {topo.world_size}, micro {c.micro} x accum {c.accum}, "
            f"{'bf16' if self.bf16 else 'fp32'} on {topo.device.type}; steps {state.step}->"
            f"{cfg.schedule.total_steps}; run dir {self.run_dir}; checkpoints "
            f"{cfg.resolved_checkpoint_root}"
        )
        return None

    # ------------------------------------------------------------------ steps
    def _train(self, c: Components, s: TrainState) -> RunResult | None:
        """The steps up to schedule.total_steps; a RunResult when the run stops early."""
        cfg, topo = self.cfg, self._topo
        device, total = topo.device, cfg.schedule.total_steps
        self._pbar = progress_bar(s.step, total, topo.is_main and cfg.train.progress_bar)
        batches = endless_batches(c.train_loader)
        meter = Throughput(
            s.step, total, cfg.train.global_batch_size * cfg.data.seq_len,
            c.flops_per_token, peak_flops(device), topo.world_size,
        )  # fmt: skip
        notice = FirstStepNotice(self.log, device.type, s.step + 1)
        o, sched = cfg.optim, cfg.schedule
        prof = open_profiler(cfg.profiling, topo.rank, self.run_dir, s.step, device, self.log)
        try:
            while s.step < total:
                t0 = time.perf_counter()
                lr = optim_lib.lr_at(s.step, o.lr, sched.warmup_steps, total, sched.min_lr_ratio)
                r = train_step(
                    c.train_module, batches, lr=lr, accum=c.accum, grad_clip=o.grad_clip,
                    device=device, mean_over_ranks=topo.all_reduce_mean, autocast=self._autocast,
                    carry=s.carry, stateful=cfg.train.stateful_windows,
                    poison=cfg.debug.poisons(s.step),
                )  # fmt: skip
                notice.done()
                s.step += 1
                self._stepped = True
                s.tokens += meter.tokens_per_step
                s.carry = r.carry
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                self._record_step(c, s, r, lr, time.perf_counter() - t0, meter)
                prof.step(s.step)  # before any scheduled eval / checkpoint: not in the trace
                stopped = self._after_step(c, s)
                if stopped is not None:
                    return stopped
        finally:
            notice.done()
            prof.close()  # (a CUDA out-of-memory error in flight: a memory snapshot)
            if self._pbar is not None:  # the bar ends with the steps; the summary follows it
                self._pbar.close()
                self._pbar = None
        if meter.steps(s.step):
            self.log(meter.summary(s.step))
        return None

    def _record_step(
        self, c: Components, s: TrainState, r: StepResult, lr: float, dt: float, meter: Throughput
    ) -> None:
        """The step's lines and metrics (and the count of skipped updates)."""
        cfg, cpu = self.cfg, self._topo.device.type == "cpu"
        if r.applied:
            s.in_a_row = 0
        else:
            s.skipped += 1
            s.in_a_row += 1
            self.log(
                f"step {s.step}: non-finite loss or gradient (loss {r.loss}, grad "
                f"norm {r.grad_norm}); update skipped ({s.in_a_row} in a row, "
                f"{s.skipped} in total)"
            )
        tps, mfu = meter.add(s.step, dt)
        if s.step % cfg.train.log_every == 0 or s.step == meter.total or not r.applied:
            if self._pbar is None:  # a log file (SLURM): plain lines, no bar
                self.log(
                    progress_line(
                        s.step, meter.total, r.loss, lr, tps, mfu, meter.s_per_step(s.step)
                    )
                )
            self._emit(
                {
                    "train/loss": r.loss,
                    "lr": lr,
                    "grad_norm": r.grad_norm,
                    "tokens_per_s": tps,
                    "mfu": mfu,
                    "step_time_s": dt,
                    "mem_gb": memory_gb(self._topo.device),
                    "skipped_steps": s.skipped,
                    "step_skipped": not r.applied,
                    # CPU only: without a device sync GPU times would lie
                    **(r.breakdown(dt, c.train_module.last_optim_s) if cpu else {}),
                },
                s.step,
                s.tokens,
            )
        for callback in self.callbacks:
            metrics = callback.after_step(c.train_module.model, r.last_batch, s.step)
            if metrics:
                self._emit(metrics, s.step, s.tokens)
        if self._pbar is not None:
            self._pbar.update(1)
            self._pbar.set_postfix(loss=f"{r.loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        if cfg.debug.step_sleep:
            time.sleep(cfg.debug.step_sleep)

    def _after_step(self, c: Components, s: TrainState) -> RunResult | None:
        """Stop on too many non-finite steps or a preemption; else the scheduled eval and
        checkpoint."""
        cfg, total, every = self.cfg, self.cfg.schedule.total_steps, self.cfg.checkpoint.every_steps
        if s.in_a_row >= cfg.train.max_nonfinite_in_a_row:
            msg = (
                f"stopping at step {s.step}: {s.in_a_row} consecutive steps had a "
                f"non-finite loss or gradient (train.max_nonfinite_in_a_row="
                f"{cfg.train.max_nonfinite_in_a_row}); the last good checkpoint is "
                f"{s.last_ckpt or 'none (no checkpoint was written)'}; lower optim.lr "
                "or check the data, then --resume auto"
            )
            self.log(msg)
            self._emit({"event": "stopped_nonfinite", "skipped_steps": s.skipped}, s.step, s.tokens)
            return RunResult(
                EXIT_NONFINITE, s.step, s.tokens, self.run_dir, s.last_ckpt,
                skipped_steps=s.skipped, message=msg,
            )  # fmt: skip
        # The preemption save comes first: a scheduled eval must not spend the grace.
        if self._stop_requested():
            self._save(c, s)
            return self._preempted(s)
        if cfg.eval.every_steps and s.step % cfg.eval.every_steps == 0 and s.step < total:
            s.final_eval = self._evaluate(c, s)
        if every and s.step % every == 0 and s.step < total:
            self._save(c, s)  # a signal during it: that save is the preemption's, no more steps
            return self._preempted(s) if self._stop_requested() else None
        return None

    # ------------------------------------------------------------------ finish
    def _finish(self, c: Components, s: TrainState) -> RunResult:
        """The final eval, the final checkpoint and the DONE marker."""
        cfg = self.cfg
        if cfg.eval.at_end and self._stop_requested():  # (a resumed run evaluates later)
            self._save(c, s)
            return self._preempted(s)
        if cfg.eval.at_end:
            s.final_eval = self._evaluate(c, s)
        # A signal during the final eval (still handled): the save below and DONE follow
        # at once, so the run finishes within the grace; save_final=false saves then too.
        late_stop = self._stop_requested()
        if cfg.checkpoint.save_final or late_stop:
            self._save(c, s)
        if cfg.checkpoint.export_final:
            sd = c.train_module.full_state_dict()
            if sd is not None:
                torch.save(sd, Path(self.run_dir) / FINAL_WEIGHTS)
        ckpt = s.last_ckpt
        self._ckpt.write_done(
            {
                "step": s.step,
                "tokens": s.tokens,
                "final_eval_loss": s.final_eval.get("eval/loss"),
                "params": c.n_params,
                "flops": c.flops_per_token * s.tokens,
                "skipped_steps": s.skipped,
                # Both relative to the checkpoint root holding DONE when local (it travels
                # with the folder), else absolute (io/run_folder.py).
                "checkpoint": ckpt.rstrip("/").rsplit("/", 1)[-1] if ckpt else None,
                "run_dir": record_run_dir(self.run_dir, c.mgr.root),
            }
        )
        ev = s.final_eval
        self.log(
            f"done: step {s.step}, {s.tokens:,} tokens"
            + (f", held-out loss {ev['eval/loss']:.4f} (ppl {ev['eval/ppl']:.2f})" if ev else "")
            + f"; checkpoint {ckpt}; metrics {Path(self.run_dir) / METRICS}"
        )
        return RunResult(0, s.step, s.tokens, self.run_dir, ckpt, ev, s.skipped)

    # ------------------------------------------------------------------ pieces
    def _save(self, c: Components, s: TrainState) -> None:
        """A checkpoint of step s.step, unless the newest one already is."""
        if last_ckpt_step(s.last_ckpt) == s.step:
            return
        sync_sinks(self._sinks)  # the history up to this step is on disk before the checkpoint
        s.last_ckpt = self._ckpt.save(c.train_module, s, c.train_loader, c.model_cfg)
        self._emit({"event": "checkpoint", "checkpoint": s.last_ckpt}, s.step, s.tokens)
        sync_sinks(self._sinks)

    def _stop_requested(self) -> bool:
        """All ranks agree (one all-reduce MAX) whether to stop now: a preemption signal on
        any rank, or the job's wall-clock deadline passed on any rank; LeaseLost when the
        run's lease was taken over."""
        if self._stops.flag is None:
            return False
        lost = self.ckpt.lease_lost() if self.ckpt is not None else None  # rank 0's, no I/O
        vote = self._topo.all_reduce_max(2.0 if lost else float(self._stops.local_request()))
        if vote >= 2:  # another job took the run over: stop at once, write nothing more
            raise LeaseLost(lost or LOST_ON_RANK_0)
        return vote > 0

    def _requeue_and_agree(self) -> None:
        """Ask SLURM to requeue (a preemption, not a Ctrl-C); then no rank exits before every
        rank is past the save: with srun --kill-on-bad-exit the first exit 75 kills the others."""
        self._stops.requeue_if_preempted(self._topo.is_main, self.log)
        self._topo.barrier()

    def _preempted(self, s: TrainState) -> RunResult:
        self._ckpt.wait_saved()  # a background save (checkpoint.async_mode) has committed
        self.log(
            f"preempted ({self._stops.why_preempted()}) at step {s.step}: saved "
            f"{s.last_ckpt}; exiting {EXIT_PREEMPTED}; continue with --resume auto"
        )
        self._emit({"event": "preempted"}, s.step, s.tokens)
        self._requeue_and_agree()
        return RunResult(
            EXIT_PREEMPTED, s.step, s.tokens, self.run_dir, s.last_ckpt,
            skipped_steps=s.skipped, message="preempted",
        )  # fmt: skip

    def _stopped_in_setup(self, s: TrainState) -> RunResult:
        """A Ctrl-C or preemption signal before the first step: stop without training (a
        step trained only to be saved would be a step nobody asked for), leave nothing new,
        exit 75 (a rerun starts where this one would have)."""
        why = self._stops.why_stopped_in_setup()
        self._remove_new_dirs()
        self.log(
            f"stopped ({why}) during the setup, before step {s.step + 1}: nothing trained or "
            f"saved; exiting {EXIT_PREEMPTED}; rerun to start (--resume auto)"
        )
        self._requeue_and_agree()
        return RunResult(
            EXIT_PREEMPTED, s.step, s.tokens, self.run_dir, None, skipped_steps=s.skipped,
            message="stopped during the setup",
        )  # fmt: skip

    def _remove_new_dirs(self) -> None:
        """Remove what this run created (directories that did not exist, and config.yaml /
        metrics.jsonl where the run dir did); never anything that was there before."""
        if self.topo is not None and not self.topo.is_main:
            return
        if not self.eval_only and self.ckpt is not None and self.ckpt.run_in_use():
            return  # another job holds the run's lease: what we found missing may be its now
        import shutil

        for path in self._new_dirs:
            shutil.rmtree(path, ignore_errors=True)
        for file in self._new_files:
            file.unlink(missing_ok=True)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.bf16:
            return torch.autocast(self._topo.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _evaluate(self, c: Components, s: TrainState) -> dict[str, float]:
        from gpn_scale.train.heldout import heldout_loss

        c.val_loader.load_state_dict(c.val_start)
        if self.cfg.debug.eval_sleep:
            time.sleep(self.cfg.debug.eval_sleep)
        c.train_module.train(False)
        try:
            result = heldout_loss(
                c.train_module.eval_forward,
                c.val_loader,
                self.cfg.eval.batches,
                self._topo.device,
                self._autocast,
                self._topo.sum_over_data_parallel,
            )
        finally:
            c.train_module.train(True)
        self._emit(result, s.step, s.tokens)
        if self._pbar is not None:
            self._pbar.write(
                f"step {s.step}: held-out loss {result['eval/loss']:.4f} "
                f"(ppl {result['eval/ppl']:.2f})"
            )
        return result

    def _emit(self, metrics: dict[str, Any], step: int, tokens: int) -> None:
        for sink in self._sinks:
            sink.log({"tokens": tokens, **metrics}, step=step)
