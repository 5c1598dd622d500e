"""The training loop. Read `Trainer.run` top to bottom: it is the recipe.

    setup:   topology -> determinism/seed -> model config -> checkpoint manager (preflight)
             -> data -> model -> backend (none / FSDP2 / DeepSpeed) -> optimizer -> resume
             -> sinks
    step:    lr(step) -> accumulate micro-batches (loss/accum backward) -> global loss
             -> global grad norm + clip -> skip if non-finite, else optimizer step
             -> metrics -> [eval] -> [checkpoint] -> [preemption: save, exit 75]
    finish:  eval -> final checkpoint -> DONE marker

Everything that depends on the backend is in the small `_Backend` classes below; the loop
itself does not branch on FSDP2 vs DeepSpeed except through them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from gpn_scale.checkpoint.rng import capture_rng_state, restore_rng_state
from gpn_scale.core.config import ConfigError
from gpn_scale.core.env import detect
from gpn_scale.core.hardware import device_peak_flops as peak_flops  # MFU's denominator
from gpn_scale.parallel.topology import Topology, init_topology
from gpn_scale.train import optim as optim_lib
from gpn_scale.train.config import DEFAULT_CORPUS, TrainConfig, batch_layout, to_yaml
from gpn_scale.train.preflight import (
    DONE_MARKER,
    check_model_compatible,
    finished_at,
    last_ckpt_step,
)
from gpn_scale.train.run_paths import record_run_dir, relocatable, resolve_recorded
from gpn_scale.train.signals import (
    EXIT_NONFINITE,
    EXIT_PREEMPTED,
    PreemptionFlag,
    job_deadline,
    request_slurm_requeue,
)

# Written to the checkpoint root when a run finishes; sweeps skip runs that have it.


class TrainingError(RuntimeError):
    """The run cannot continue; the message is one line and says what to do."""


def training_flops_per_token(model_cfg, seq_len: int) -> float:
    """The model's own training FLOPs/token (forward + backward), from its family's spec."""
    from gpn_scale.models.registry import family_of

    return float(family_of(model_cfg).flops_per_token(model_cfg, seq_len))


def resolve_deterministic(value: bool | str, device: torch.device) -> bool:
    """train.deterministic: "auto" = on CPU only (see TrainSection), true/false as given."""
    return device.type == "cpu" if value == "auto" else bool(value)


def set_determinism(cfg: TrainConfig, device: torch.device) -> bool:
    """Threads and deterministic algorithms; returns whether the latter are on."""
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    deterministic = resolve_deterministic(cfg.train.deterministic, device)
    if deterministic:
        # warn_only: a few CUDA kernels have no deterministic variant; on CPU all of ours do.
        torch.use_deterministic_algorithms(True, warn_only=True)
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False
    return deterministic


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# --------------------------------------------------------------------------- backends
class _Backend:
    """What the loop needs from a parallelism backend."""

    name = "none"
    last_optim_s = 0.0  # time of the last optimizer step (0 where the engine does it inside)
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def forward_loss(
        self, tokens: torch.Tensor, state: Any = None, want_state: bool = False
    ) -> tuple[torch.Tensor, Any]:
        out = self.model(tokens, state=state, return_state=want_state)
        return out.loss, out.state

    def backward(self, loss: torch.Tensor, accum: int, last_micro: bool) -> None:
        (loss / accum).backward()

    def clip_and_step(self, grad_clip: float, lr: float, loss_finite: bool) -> tuple[float, bool]:
        """Returns (grad norm, applied). Skips the update when the norm or loss is not finite."""
        norm = optim_lib.grad_norm_and_clip(self.model.parameters(), grad_clip)
        norm_f = float(norm)
        applied = loss_finite and math.isfinite(norm_f)
        t0 = time.perf_counter()
        if applied:
            optim_lib.set_lr(self.optimizer, lr)
            self.optimizer.step()
        self.last_optim_s = time.perf_counter() - t0
        self.optimizer.zero_grad(set_to_none=True)
        return norm_f, applied

    def weights_finite(self) -> bool:
        for p in self.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if not bool(torch.isfinite(local.detach()).all()):
                return False
        return True

    def eval_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).loss

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the unsharded weights on rank 0 (None elsewhere)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return None
        return {k: v.detach().cpu().clone() for k, v in sd.items()}

    def train(self, mode: bool) -> None:
        self.model.train(mode)

    # Checkpoint plumbing (torch DCP via the CheckpointManager).
    def save(self, mgr, step: int, meta: dict, rank_state: dict, files: dict) -> str:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        return mgr.save(
            step, {"model": msd, "optim": osd}, meta=meta, rank_state=rank_state, files=files
        )

    def load(self, mgr, uri: str):
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        app_state = {"model": msd, "optim": osd}
        ck = mgr.load(uri, app_state)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=app_state["model"],
            optim_state_dict=app_state["optim"],
        )
        return ck


class _PlainBackend(_Backend):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer


class _FSDP2Backend(_Backend):
    name = "fsdp2"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def backward(self, loss: torch.Tensor, accum: int, last_micro: bool) -> None:
        # Reduce-scatter gradients only on the last micro-batch of an accumulation.
        self.model.set_requires_gradient_sync(last_micro)
        (loss / accum).backward()


class _DeepSpeedBackend(_Backend):
    name = "deepspeed"

    def __init__(self, engine, ds_optimizer) -> None:
        self.engine, self.model, self.optimizer = engine, engine.module, ds_optimizer

    def forward_loss(self, tokens, state=None, want_state=False):
        out = self.engine(tokens, state=state, return_state=want_state)
        return out.loss, out.state

    def backward(self, loss, accum, last_micro):
        self.engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
        self.engine.step()  # only steps at the accumulation boundary

    def clip_and_step(self, grad_clip, lr, loss_finite):
        # DeepSpeed clipped and stepped (or skipped on inf/NaN) inside the last engine.step().
        from gpn_scale.parallel.deepspeed import step_was_skipped

        norm = self.engine.get_global_grad_norm()
        norm_f = float(norm) if norm is not None else float("nan")
        applied = not step_was_skipped(self.engine) and loss_finite and math.isfinite(norm_f)
        return norm_f, applied

    def set_lr(self, lr: float) -> None:
        optim_lib.set_lr(self.optimizer, lr)

    def weights_finite(self) -> bool:
        from gpn_scale.parallel.deepspeed import local_params

        return all(bool(torch.isfinite(p.detach()).all()) for p in local_params(self.engine))

    def eval_forward(self, tokens):
        return self.engine(tokens).loss

    def full_state_dict(self):
        import deepspeed
        import torch.distributed as dist

        params = list(self.model.parameters())
        # ZeRO-3 partitions the weights; gathering is a no-op for stages 1-2 (full copies).
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            sd = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return sd if dist.get_rank() == 0 else None

    def train(self, mode):
        self.engine.train(mode)

    def save(self, mgr, step, meta, rank_state, files):
        return mgr.save_deepspeed(step, self.engine, meta=meta, rank_state=rank_state, files=files)

    def load(self, mgr, uri):
        return mgr.load_deepspeed(uri, self.engine)


# --------------------------------------------------------------------------- trainer
@dataclass
class RunResult:
    exit_code: int
    step: int
    tokens: int
    run_dir: str
    checkpoint: str | None = None
    final_eval: dict[str, float] = field(default_factory=dict)
    skipped_steps: int = 0
    message: str = ""


class Trainer:
    """resume: 'auto' | 'none' | a checkpoint URI. 'none' refuses a checkpoint root that
    already holds checkpoints or DONE unless fresh=True, which deletes them (and the run's
    metrics history) once the setup has succeeded, then starts at step 0."""

    def __init__(
        self,
        cfg: TrainConfig,
        resume: str = "none",
        log: Callable[[str], None] | None = None,
        eval_only: bool = False,
        fresh: bool = False,
        take_over: bool = False,
    ) -> None:
        self.cfg = cfg
        self.eval_only = eval_only  # `gpn-scale eval`: restore, evaluate, write nothing
        self.resume = resume
        self.fresh = fresh
        self.take_over = take_over  # replace another job's live lease on the run
        self._lease: Any = None
        self._log = log or (lambda msg: print(msg, flush=True))
        self._log_is_print = log is None

    def log(self, msg: str) -> None:
        if self.topo is None or self.topo.is_main:
            if self._pbar is not None and self._log_is_print:
                self._pbar.write(msg)  # above the progress bar, not through it
            else:
                self._log(msg)

    topo: Topology | None = None
    _pbar: Any = None

    # ------------------------------------------------------------------ setup
    def _setup_topology(self) -> None:
        cfg = self.cfg
        env = detect()
        backend = cfg.parallel.backend
        if backend == "auto":
            backend = "fsdp2" if env.distributed else "none"
        if backend == "none" and env.distributed:
            raise ConfigError(
                "parallel.backend: none cannot run on several processes; use fsdp2 or deepspeed"
            )
        self.backend_name = backend
        if (
            backend in ("fsdp2", "deepspeed")
            and not env.distributed
            and "MASTER_PORT" not in os.environ
        ):
            import dataclasses

            from gpn_scale.parallel.topology import free_port

            env = dataclasses.replace(env, master_port=free_port())  # a 1-rank group's rendezvous
        # fully_shard needs a process group (without one it dies asking for RANK): one process
        # runs FSDP2 as a 1-rank group, so its checkpoints are those of any other world size.
        fsdp2_alone = backend == "fsdp2" and not env.distributed
        if fsdp2_alone:
            print(
                "parallel.backend=fsdp2 in one process: running FSDP2 as a 1-rank group "
                "(launch with torchrun for data parallelism)",
                file=sys.stderr,
                flush=True,
            )
        if backend == "deepspeed":  # DeepSpeed wants its process group even for one process
            from gpn_scale.core.env import export_for_torch
            from gpn_scale.parallel import deepspeed as ds
            from gpn_scale.parallel.topology import pick_device

            export_for_torch(env)
            device = pick_device(cfg.train.device, env.local_rank)
            ds.init_distributed("nccl" if device.type == "cuda" else "gloo")
        self.topo = init_topology(
            env, cfg.train.device, tp=cfg.parallel.tp, group_for_one=fsdp2_alone
        )

    def _model_config(self):
        from gpn_scale.train.preflight import model_config

        return model_config(self.cfg)  # errors name model_overrides.<key> / train.tbptt

    def _data_remote(self) -> str:
        cfg = self.cfg
        if cfg.data.remote != DEFAULT_CORPUS:
            return cfg.data.remote
        # The embedded default corpus, built once per run dir by rank 0 (others wait).
        out = Path(self.run_dir) / "data" / f"default_corpus_T{cfg.data.seq_len}"
        if self.topo.is_main:
            from data_tools.default_corpus import build_default_dataset

            root = build_default_dataset(str(out), seq_len=cfg.data.seq_len, seed=0)
        self.topo.barrier()
        return str(root) if self.topo.is_main else str(out)

    def _build_loader(self, split: str, batch: int, remote: str, vocab: int):
        from gpn_scale.data import DataConfig, build_loader

        cfg = self.cfg
        cache = cfg.data.local_cache or self._default_cache()
        dcfg = DataConfig(
            remote=remote,
            local_cache=cache,
            shuffle_seed=cfg.data.shuffle_seed,
            num_canonical_nodes=cfg.data.num_canonical_nodes,
            num_workers=cfg.data.num_workers,
        )
        topo = self.topo
        tp = topo.tp_size
        if batch % tp:
            raise ConfigError(
                f"parallel.tp: {tp} does not divide the {split} micro batch {batch} per data-"
                "parallel rank (a tp group reads it in tp pieces); change the batch or tp"
            )
        loader = build_loader(
            dcfg,
            split=split,
            batch_size=batch // tp,
            # Under TP every rank reads 1/tp of its group's batch (parallel/tp.py).
            rank=topo.dp_rank if tp == 1 else topo.rank,
            world_size=topo.dp_size if tp == 1 else topo.world_size,
            seq_len=cfg.data.seq_len,
            vocab_size=vocab,
        )
        self._loaders.append(loader)  # closed when the run ends (run's finally)
        if tp > 1:
            from gpn_scale.parallel.tp import TPGroupBatches

            return TPGroupBatches(loader, topo.tp_mesh.get_group(), tp)
        return loader

    def _default_cache(self) -> str:
        """<run_dir>/data/cache for training; eval only reads the run, so its shard copies
        go to a temporary directory of their own (removed when the run object ends)."""
        if not self.eval_only:
            return str(Path(self.run_dir) / "data" / "cache")
        if getattr(self, "_eval_cache", None) is None:
            import tempfile

            self._eval_cache = tempfile.mkdtemp(prefix="gpn_eval_cache_")
        return str(self._eval_cache)

    def _build_backend(
        self, model: nn.Module, micro: int, accum: int, fsdp_units: list[nn.Module]
    ) -> _Backend:
        cfg, topo = self.cfg, self.topo
        betas = (cfg.optim.beta1, cfg.optim.beta2)
        fused = cfg.optim.fused and topo.device.type == "cuda"
        if self.backend_name == "deepspeed":
            from gpn_scale.parallel import deepspeed as ds

            ds.prepare_env()
            optimizer = optim_lib.build_adamw(
                model, cfg.optim.lr, betas, cfg.optim.eps, cfg.optim.weight_decay, fused=fused
            )
            ds_cfg = ds.ds_config(
                global_batch=cfg.train.global_batch_size,
                micro_batch=micro,
                accum=accum,
                grad_clip=cfg.optim.grad_clip,
                zero_stage=cfg.parallel.zero_stage,
                bf16=self.bf16,
                persistence_threshold=cfg.parallel.zero3_persistence_threshold,
            )
            engine, ds_opt = ds.wrap(model, optimizer, ds_cfg)
            if cfg.parallel.zero_stage == 3:
                parts = sum(
                    1
                    for p in engine.module.parameters()
                    if getattr(p, "ds_tensor", p).numel() < p.ds_numel
                )
                self.log(
                    f"deepspeed: ZeRO-3 partitions {parts} of "
                    f"{len(list(engine.module.parameters()))} parameters"
                )
            return _DeepSpeedBackend(engine, ds_opt)
        if self.backend_name == "fsdp2":
            from gpn_scale.parallel.fsdp import apply_fsdp2

            if topo.tp_size > 1:  # TP first, then FSDP2 over "dp" of the same parent mesh
                from gpn_scale.models.registry import family_of

                apply_tp = family_of(self._model_config()).apply_tp
                assert apply_tp is not None  # checked in setup
                apply_tp(model, topo.tp_mesh)

            # Compute dtype comes from autocast (bf16 on GPU), not from FSDP's param_dtype:
            # fp32 weights + autocast is what the model's fp32-state rule is written for
            # (bf16 param_dtype would halve the all-gathers; a later option).
            apply_fsdp2(
                model,
                topo.dp_mesh,
                units=fsdp_units,
                param_dtype=None,
                reduce_dtype=cfg.parallel.reduce_dtype,
                reshard_after_forward=cfg.parallel.reshard_after_forward,
            )
            optimizer = optim_lib.build_adamw(
                model, cfg.optim.lr, betas, cfg.optim.eps, cfg.optim.weight_decay, fused=fused
            )
            return _FSDP2Backend(model, optimizer)
        optimizer = optim_lib.build_adamw(
            model, cfg.optim.lr, betas, cfg.optim.eps, cfg.optim.weight_decay, fused=fused
        )
        return _PlainBackend(model, optimizer)

    def _autocast(self):
        if self.bf16:
            return torch.autocast(self.topo.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ run
    def run(self) -> RunResult:
        cfg = self.cfg
        self.run_dir = cfg.resolved_run_dir
        # What a failed start must not leave behind: the directories it would create.
        self._new_dirs = _missing_tops(
            [
                self.run_dir,
                str(Path(self.run_dir) / "data"),
                cfg.resolved_checkpoint_root,
                cfg.data.local_cache,
            ]
        )
        self._started = False
        self._loaders: list = []
        # Installed before the setup and kept through the final eval, save and DONE: a
        # preemption signal in any of those windows is acted on, never fatal.
        self._flag = PreemptionFlag().install() if cfg.preemption.enabled else None
        self._deadline = (
            job_deadline(os.environ, cfg.preemption.end_margin_s)
            if cfg.preemption.enabled
            else None
        )
        self._deadline_hit = False
        try:
            self._setup_topology()
        except BaseException:
            if self._flag is not None:
                self._flag.uninstall()
            raise
        topo = self.topo
        try:
            result = self._run()
            if self.eval_only:
                self._remove_new_dirs()
            return result
        except ConfigError:
            # exit 2 before anything was trained (a bad setting, or bad data met by the first
            # batch): leave nothing that was not there before
            if not self._started or not getattr(self, "_stepped", True):
                # writers first: a loader's download threads would refill its cache
                for closeable in [*getattr(self, "_sinks", []), *self._loaders]:
                    with contextlib.suppress(Exception):
                        closeable.close()
                self._remove_new_dirs()
            raise
        finally:
            if hasattr(self, "_pbar") and self._pbar is not None:
                self._pbar.close()
            for sink in getattr(self, "_sinks", []):
                with contextlib.suppress(Exception):
                    sink.close()
            for loader in self._loaders:
                with contextlib.suppress(Exception):
                    loader.close()
            if getattr(self, "_eval_cache", None):
                import shutil

                shutil.rmtree(self._eval_cache, ignore_errors=True)
            if self._lease is not None:
                self._lease.release()
            if self._flag is not None:
                self._flag.uninstall()
            topo.destroy()

    def _run(self) -> RunResult:
        from gpn_scale.checkpoint import CheckpointManager
        from gpn_scale.models.registry import family_of

        cfg, topo = self.cfg, self.topo
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
        model_cfg = self._model_config()
        from gpn_scale.train.preflight import check_tensor_parallel

        check_tensor_parallel(model_cfg, topo.tp_size)
        from gpn_scale.train.preflight import check_model_device

        check_model_device(cfg, model_cfg, device.type)
        seq_len = cfg.data.seq_len

        # Checkpoint storage first: a bad path or missing credentials fails before any work.
        if not self.eval_only:
            from gpn_scale.train.preflight import check_run_dir

            check_run_dir(self.run_dir)  # names run_dir, not the checkpoint root under it
        mgr = CheckpointManager(cfg.resolved_checkpoint_root, keep_last=cfg.checkpoint.keep_last)
        if not self.eval_only:  # eval only reads: a read-only run (or mount) evaluates
            self._new_dirs += _missing_tops([mgr.staging_root])
            mgr.preflight()
        resume_uri = mgr.resolve_resume(self.resume) if self.resume != "none" else None
        for uri, reason in mgr.skipped if self.resume == "auto" else ():
            self.log(f"resume auto: skipped {uri} (step {last_ckpt_step(uri)}): {reason}")
        warm = None  # checkpoint.initial_load: checked before anything is written
        if cfg.checkpoint.initial_load and not self.eval_only:
            if resume_uri:
                self.log(
                    f"checkpoint.initial_load: ignored, the run resumes its own checkpoint "
                    f"{resume_uri}"
                )
            else:
                warm = self._initial_load_source(model_cfg)
        if self.eval_only and resume_uri is None and not _no_resume(self.resume):
            raise ConfigError(
                f"eval: no complete checkpoint under {mgr.root} to evaluate; "
                "pass --checkpoint URI, the run's run_dir / checkpoint.root, or "
                "--checkpoint none for the untrained model"
            )
        if not self.eval_only:
            finished = self._check_existing_run(mgr, resume_uri)
            if finished is not None:
                return finished
            self._take_lease(mgr)

        if topo.is_main and not self.eval_only:
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
        topo.barrier()
        remote = self._data_remote()
        from gpn_scale.train.preflight import check_data

        data_meta = check_data(
            cfg,
            remote,
            model_cfg.vocab_size,
            micro,
            topo.dp_size,
            evaluates=self.eval_only or cfg.eval.at_end or cfg.eval.every_steps > 0,
        )
        # Saved with every checkpoint: eval and generation find the tokenizer without the
        # training data (eval/load.py).
        self._tokenizer_identity, self._ckpt_files = _tokenizer_record(data_meta.tokenizer)
        self._data_fingerprint, self._remote = data_meta.fingerprint, remote
        if resume_uri:  # before any loader streams: data of another tokenizer is refused
            self._check_same_data(mgr.read_meta(resume_uri), resume_uri)
        if warm is not None:
            self._check_same_data(warm.meta, warm.uri)
        train_loader = self._build_loader("train", micro, remote, model_cfg.vocab_size)
        eval_batch = cfg.eval.batch_size or micro
        val_loader = self._build_loader("val", eval_batch, remote, model_cfg.vocab_size)
        val_start = val_loader.state_dict()  # fixed windows: every eval restarts here

        # Same seed on every rank: identical initial weights before any sharding.
        seed_everything(cfg.seed)
        spec = family_of(model_cfg)
        model = spec.build(model_cfg).to(device)
        if warm is not None and cfg.checkpoint.initial_load_model_only:
            self._load_initial_weights(model, warm, spec, model_cfg)  # before any sharding
        n_params = sum(p.numel() for p in model.parameters())
        flops_tok = training_flops_per_token(model_cfg, seq_len)
        backend = self._build_backend(model, micro, accum, spec.fsdp_units(model))
        backend.train(True)
        if warm is not None and not cfg.checkpoint.initial_load_model_only:
            from gpn_scale.checkpoint import CheckpointManager as Manager

            backend.load(Manager(warm.uri.rstrip("/").rsplit("/", 1)[0]), warm.uri)
        if warm is not None:
            what = "weights" + ("" if cfg.checkpoint.initial_load_model_only else " and optimizer")
            fresh = (
                "fresh optimizer, schedule and data position"
                if cfg.checkpoint.initial_load_model_only
                else "its optimizer state; fresh schedule and data position"
            )
            step_of = warm.meta.get("step")
            self.log(
                f"checkpoint.initial_load: {what} of {warm.uri}"
                + (f" (step {step_of})" if step_of is not None else "")
                + f"; starting at step 0 ({fresh})"
            )

        step, tokens, skipped, wandb_id = 0, 0, 0, None
        if self.resume == "auto" and resume_uri is None and not self.eval_only:
            self.log(f"resume auto: no complete checkpoint under {mgr.root}; starting fresh")
        if resume_uri and self.eval_only and self.resume == "auto":
            resume_uri, (step, tokens, skipped, wandb_id) = self._restore_newest(
                mgr, resume_uri, backend, train_loader, model_cfg
            )
        elif resume_uri:
            step, tokens, skipped, wandb_id = self._restore(
                mgr, resume_uri, backend, train_loader, model_cfg
            )

        if self.eval_only:
            if resume_uri is None:
                self.log("eval: --checkpoint none: evaluating the untrained model")
            result = self._evaluate(backend, val_loader, val_start, step, tokens)
            return RunResult(0, step, tokens, self.run_dir, resume_uri, result)
        if cfg.debug.setup_sleep:
            self.log(f"debug: sleeping {cfg.debug.setup_sleep:g}s at the end of the setup")
            time.sleep(cfg.debug.setup_sleep)
        if self._stop_requested():  # Ctrl-C or a preemption signal during the setup
            return self._stopped_in_setup(step, tokens, skipped)
        if self.fresh:  # the explicit choice, acted on only now that the setup has worked
            self._discard_previous_run(mgr)
        # A fresh start (step 0) drops the history of an earlier attempt that left no
        # checkpoint, as a resume drops the steps after its checkpoint: one history per run.
        run_path = Path(self.run_dir)
        self._new_files = [
            p for p in (run_path / "config.yaml", run_path / "metrics.jsonl") if not p.exists()
        ]
        self._open_sinks(step, wandb_id, model_cfg, n_params)
        self._started = True
        self._stepped = False  # no optimizer step or checkpoint of this process yet
        if self._flag is not None:
            self._flag.phase = "training"
        tokens_per_step = cfg.train.global_batch_size * seq_len
        total = cfg.schedule.total_steps
        peak = peak_flops(device)
        self.log(
            f"train: {model_cfg.name or cfg.model} ({n_params:,} params), backend "
            f"{self.backend_name}, world {topo.world_size}, micro {micro} x accum {accum}, "
            f"{'bf16' if self.bf16 else 'fp32'} on {device.type}; steps {step}->{total}; "
            f"run dir {self.run_dir}; checkpoints {cfg.resolved_checkpoint_root}"
        )

        self._pbar = self._progress(step, total)
        data = self._batches(train_loader)
        t_loop, step0 = time.perf_counter(), step  # for the ETA of the plain progress lines
        tps_sum, mfu_sum, timed_steps = 0.0, 0.0, 0  # the end-of-run summary's means
        notice = FirstStepNotice(self.log, device.type, step + 1)
        state = None
        in_a_row = 0
        last_ckpt = resume_uri
        final_eval: dict[str, float] = {}
        try:
            while step < total:
                t0 = time.perf_counter()
                lr = optim_lib.lr_at(
                    step, cfg.optim.lr, cfg.schedule.warmup_steps, total, cfg.schedule.min_lr_ratio
                )
                if isinstance(backend, _DeepSpeedBackend):
                    backend.set_lr(lr)  # before engine.step() applies it
                loss_sum = torch.zeros((), dtype=torch.float32, device=device)
                t_data = 0.0
                for i in range(accum):
                    td = time.perf_counter()
                    tokens_b = next(data).to(device, non_blocking=True)
                    t_data += time.perf_counter() - td
                    with self._autocast():
                        loss, new_state = backend.forward_loss(
                            tokens_b, state, want_state=cfg.train.stateful_windows
                        )
                    if self._inject_nan(step):
                        loss = loss * float("nan")
                    backend.backward(loss, accum, last_micro=i == accum - 1)
                    loss_sum += loss.detach().float()  # stays on device: one sync per step
                    if cfg.train.stateful_windows and new_state is not None:
                        state = new_state.detach()
                loss_val = float(topo.all_reduce_mean(loss_sum / accum))
                t_update = time.perf_counter()
                grad_norm, applied = backend.clip_and_step(
                    cfg.optim.grad_clip, lr, math.isfinite(loss_val)
                )
                t_update = time.perf_counter() - t_update
                notice.done()
                step += 1
                self._stepped = True
                tokens += tokens_per_step
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                if applied:
                    in_a_row = 0
                else:
                    skipped += 1
                    in_a_row += 1
                    self.log(
                        f"step {step}: non-finite loss or gradient (loss {loss_val}, grad "
                        f"norm {grad_norm}); update skipped ({in_a_row} in a row, "
                        f"{skipped} in total)"
                    )
                tps = tokens_per_step / dt
                mfu = (flops_tok * tps / (peak * topo.world_size)) if peak else None
                if step > step0 + 1 or total - step0 == 1:  # the first step compiles: not timed
                    tps_sum += tps
                    mfu_sum += mfu or 0.0
                    timed_steps += 1
                if step % cfg.train.log_every == 0 or step == total or not applied:
                    if self._pbar is None:  # a log file (SLURM): plain lines, no bar
                        self.log(
                            progress_line(
                                step,
                                total,
                                loss_val,
                                lr,
                                tps,
                                mfu,
                                (time.perf_counter() - t_loop) / (step - step0),
                            )
                        )
                    self._emit(
                        {
                            "train/loss": loss_val,
                            "lr": lr,
                            "grad_norm": grad_norm,
                            "tokens_per_s": tps,
                            "mfu": mfu,
                            "step_time_s": dt,
                            "mem_gb": memory_gb(device),
                            "skipped_steps": skipped,
                            "step_skipped": not applied,
                            **self._breakdown(dt, t_data, t_update, backend),
                        },
                        step,
                        tokens,
                    )
                if cfg.analysis.every_steps and step % cfg.analysis.every_steps == 0:
                    from gpn_scale.eval.analysis.live import live_metrics

                    live = live_metrics(backend.model, tokens_b, cfg.analysis)  # {}: not GPN
                    if live:
                        self._emit(live, step, tokens)
                if self._pbar is not None:
                    self._pbar.update(1)
                    self._pbar.set_postfix(loss=f"{loss_val:.4f}", lr=f"{lr:.2e}", refresh=False)
                if cfg.debug.step_sleep:
                    time.sleep(cfg.debug.step_sleep)

                if in_a_row >= cfg.train.max_nonfinite_in_a_row:
                    msg = (
                        f"stopping at step {step}: {in_a_row} consecutive steps had a "
                        f"non-finite loss or gradient (train.max_nonfinite_in_a_row="
                        f"{cfg.train.max_nonfinite_in_a_row}); the last good checkpoint is "
                        f"{last_ckpt or 'none (no checkpoint was written)'}; lower optim.lr "
                        "or check the data, then --resume auto"
                    )
                    self.log(msg)
                    self._emit(
                        {"event": "stopped_nonfinite", "skipped_steps": skipped}, step, tokens
                    )
                    return RunResult(
                        EXIT_NONFINITE,
                        step,
                        tokens,
                        self.run_dir,
                        last_ckpt,
                        skipped_steps=skipped,
                        message=msg,
                    )

                # The preemption save comes first: a scheduled eval must not spend the grace.
                if self._stop_requested():
                    if last_ckpt_step(last_ckpt) != step:
                        last_ckpt = self._save(
                            mgr, backend, step, tokens, skipped, train_loader, model_cfg
                        )
                    return self._preempted(step, tokens, skipped, last_ckpt)
                if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < total:
                    final_eval = self._evaluate(backend, val_loader, val_start, step, tokens)
                if (
                    cfg.checkpoint.every_steps
                    and step % cfg.checkpoint.every_steps == 0
                    and step < total
                ):
                    last_ckpt = self._save(
                        mgr, backend, step, tokens, skipped, train_loader, model_cfg
                    )
        finally:
            notice.done()
            if self._pbar is not None:  # the bar ends with the steps; the summary follows it
                self._pbar.close()
                self._pbar = None
        if step > step0:
            self.log(
                run_summary(
                    step - step0,
                    time.perf_counter() - t_loop,
                    tps_sum / timed_steps if timed_steps else None,
                    mfu_sum / timed_steps if timed_steps and peak else None,
                )
            )

        # ---- finish: eval, final checkpoint, DONE marker ------------------------------
        if cfg.eval.at_end and self._stop_requested():  # (a resumed run evaluates later)
            if last_ckpt_step(last_ckpt) != step:
                last_ckpt = self._save(mgr, backend, step, tokens, skipped, train_loader, model_cfg)
            return self._preempted(step, tokens, skipped, last_ckpt)
        if cfg.eval.at_end:
            final_eval = self._evaluate(backend, val_loader, val_start, step, tokens)
        # A signal during the final eval (still handled): the save below and DONE follow
        # at once, so the run finishes within the grace; save_final=false saves then too.
        late_stop = self._stop_requested()
        if (cfg.checkpoint.save_final or late_stop) and last_ckpt_step(last_ckpt) != step:
            last_ckpt = self._save(mgr, backend, step, tokens, skipped, train_loader, model_cfg)
        if cfg.checkpoint.export_final:
            sd = backend.full_state_dict()
            if sd is not None:
                torch.save(sd, Path(self.run_dir) / "model_final.pt")
        done = {
            "step": step,
            "tokens": tokens,
            "final_eval_loss": final_eval.get("eval/loss"),
            "params": n_params,
            "flops": flops_tok * tokens,
            "skipped_steps": skipped,
            # Both relative to the checkpoint root holding DONE when local (it travels with
            # the folder), else absolute (train/run_paths.py).
            "checkpoint": last_ckpt.rstrip("/").rsplit("/", 1)[-1] if last_ckpt else None,
            "run_dir": record_run_dir(self.run_dir, mgr.root),
        }
        if topo.is_main:
            mgr.storage.put_bytes(DONE_MARKER, json.dumps(done, indent=1).encode())
        topo.barrier()
        self.log(
            f"done: step {step}, {tokens:,} tokens"
            + (
                f", held-out loss {final_eval['eval/loss']:.4f} (ppl {final_eval['eval/ppl']:.2f})"
                if final_eval
                else ""
            )
            + f"; checkpoint {last_ckpt}; metrics {Path(self.run_dir) / 'metrics.jsonl'}"
        )
        return RunResult(0, step, tokens, self.run_dir, last_ckpt, final_eval, skipped)

    # ------------------------------------------------------------------ pieces
    def _stop_requested(self) -> bool:
        """All ranks agree (one all-reduce MAX) whether to stop now: a preemption signal on
        any rank, or the job's wall-clock deadline passed on any rank."""
        if self._flag is None:
            return False
        local = self._flag.requested
        if self._deadline is not None and time.time() >= self._deadline:
            local = self._deadline_hit = True
        return self.topo.all_reduce_max(float(local)) > 0

    def _preempted(self, step: int, tokens: int, skipped: int, last_ckpt: str | None) -> RunResult:
        flag, cfg = self._flag, self.cfg
        why = (
            f"signal {flag.signum}"
            if flag.signum
            else (
                f"the job's time limit is {cfg.preemption.end_margin_s:.0f}s away "
                "(SLURM_JOB_END_TIME)"
                if self._deadline_hit
                else "signal on another rank"
            )
        )
        self.log(
            f"preempted ({why}) at step {step}: saved {last_ckpt}; exiting "
            f"{EXIT_PREEMPTED}; continue with --resume auto"
        )
        self._emit({"event": "preempted"}, step, tokens)
        if cfg.preemption.requeue and self.topo.is_main and not flag.interrupted:
            request_slurm_requeue(self.log)
        # No rank exits before every rank is past the save: with srun --kill-on-bad-exit
        # the first exit 75 kills the others.
        self.topo.barrier()
        return RunResult(
            EXIT_PREEMPTED,
            step,
            tokens,
            self.run_dir,
            last_ckpt,
            skipped_steps=skipped,
            message="preempted",
        )

    def _take_lease(self, mgr) -> None:
        """Rank 0 takes the run's lease before anything is written; every rank agrees."""
        if not self.cfg.checkpoint.lease_ttl_s:
            return
        from gpn_scale.checkpoint.lease import LeaseHeld, RunLease

        error = None
        if self.topo.is_main:
            lease = RunLease(mgr.storage, self.cfg.checkpoint.lease_ttl_s)
            try:
                note = lease.acquire(take_over=self.take_over)
                self._lease = lease
                if note:
                    self.log(note)
            except LeaseHeld as err:
                error = str(err)
        if self.topo.all_reduce_max(1.0 if error else 0.0) > 0:
            raise LeaseHeld(error or "another job holds this run's lease (see rank 0)")

    def _check_existing_run(self, mgr, resume_uri: str | None) -> RunResult | None:
        """Refuse to start over existing checkpoints without --fresh; a finished run is
        left as it is (a RunResult: nothing to do). None: go on."""
        raw = mgr.storage.get_bytes(DONE_MARKER)
        try:
            done = json.loads(raw) if raw else None
        except ValueError:
            done = {}
        if _no_resume(self.resume):
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

    def _discard_previous_run(self, mgr) -> None:
        """--fresh: delete the earlier run's checkpoints and DONE (rank 0), then agree."""
        if self.topo.is_main:
            gone = mgr.delete_all()
            mgr.storage.delete(DONE_MARKER)
            if gone:
                self.log(f"--fresh: deleted {len(gone)} checkpoint(s) and DONE under {mgr.root}")
        self.topo.barrier()

    def _remove_new_dirs(self) -> None:
        """Remove what this run created (directories that did not exist, and config.yaml /
        metrics.jsonl where the run dir did); never anything that was there before."""
        if self.topo is not None and not self.topo.is_main:
            return
        import shutil

        for path in self._new_dirs:
            shutil.rmtree(path, ignore_errors=True)
        for file in getattr(self, "_new_files", []):
            file.unlink(missing_ok=True)

    def _stopped_in_setup(self, step: int, tokens: int, skipped: int) -> RunResult:
        """A Ctrl-C or preemption signal before the first step: stop without training (a
        step trained only to be saved would be a step nobody asked for), leave nothing new,
        exit 75 (a rerun starts where this one would have)."""
        flag = self._flag
        why = (
            f"signal {flag.signum}"
            if flag is not None and flag.signum
            else f"the job's time limit is {self.cfg.preemption.end_margin_s:.0f}s away "
            "(SLURM_JOB_END_TIME)"
        )
        if flag is not None and flag.interrupted:
            why = "Ctrl-C"
        self._remove_new_dirs()
        self.log(
            f"stopped ({why}) during the setup, before step {step + 1}: nothing trained or "
            f"saved; exiting {EXIT_PREEMPTED}; rerun to start (--resume auto)"
        )
        if (
            self.cfg.preemption.requeue
            and self.topo.is_main
            and flag is not None
            and not flag.interrupted
        ):
            request_slurm_requeue(self.log)
        self.topo.barrier()
        return RunResult(
            EXIT_PREEMPTED, step, tokens, self.run_dir, None, skipped_steps=skipped,
            message="stopped during the setup",
        )  # fmt: skip

    def _breakdown(
        self, dt: float, t_data: float, t_update: float, backend: _Backend
    ) -> dict[str, float]:
        """Where a step's time went (CPU only: without a device sync GPU times would lie).

        model = forward + backward (+ the loss all-reduce), update = grad norm + clip +
        optimizer step, optim = the optimizer step alone; data = fetching the batch. The
        engine benchmark's step is model + optim; everything else is the trainer's overhead.
        """
        if self.topo.device.type != "cpu":
            return {}
        return {
            "time/data_s": t_data,
            "time/model_s": dt - t_data - t_update,
            "time/update_s": t_update,
            "time/optim_s": backend.last_optim_s,
        }

    def _inject_nan(self, step: int) -> bool:
        d = self.cfg.debug
        return step + 1 in d.inject_nan_steps or (
            d.inject_nan_from is not None and step + 1 >= d.inject_nan_from
        )

    def _batches(self, loader) -> Iterator[torch.Tensor]:
        while True:  # epochs: iterating the loader again starts the next one
            got = False
            for batch in loader:
                got = True
                yield batch
            if not got:  # a data error (exit 2) like the others, not a training failure
                from gpn_scale.data import DataError

                raise DataError(
                    "the training split yielded no batch; lower "
                    "train.global_batch_size or use more data"
                )

    def _progress(self, step: int, total: int):
        # Not on a terminal (a SLURM log, a pipe): carriage-return redraws would fill the
        # file; the loop prints a plain line every train.log_every steps instead.
        if not (self.topo.is_main and self.cfg.train.progress_bar and sys.stderr.isatty()):
            return None
        from tqdm import tqdm

        return tqdm(
            total=total,
            initial=step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=1.0,
            file=sys.stderr,
        )

    def _evaluate(
        self, backend: _Backend, val_loader, val_start, step: int, tokens: int
    ) -> dict[str, float]:
        from gpn_scale.eval.heldout import heldout_loss

        val_loader.load_state_dict(val_start)
        if self.cfg.debug.eval_sleep:
            time.sleep(self.cfg.debug.eval_sleep)
        backend.train(False)
        try:
            result = heldout_loss(
                backend.eval_forward,
                val_loader,
                self.cfg.eval.batches,
                self.topo.device,
                self._autocast,
                self._all_reduce_sum,
            )
        finally:
            backend.train(True)
        self._emit(result, step, tokens)
        if self._pbar is not None:
            self._pbar.write(
                f"step {step}: held-out loss {result['eval/loss']:.4f} "
                f"(ppl {result['eval/ppl']:.2f})"
            )
        return result

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if not self.topo.env.distributed:
            return t
        import torch.distributed as dist

        t = t.to(self.topo._coll_device()).clone()
        if self.topo.tp_size > 1:  # the ranks of a tp group hold the same sums: count one
            dist.all_reduce(t, group=self.topo.dp_mesh.get_group())
        else:
            dist.all_reduce(t)
        return t.cpu()

    def _save(
        self, mgr, backend: _Backend, step: int, tokens: int, skipped: int, loader, model_cfg
    ) -> str:
        finite = 0.0 if backend.weights_finite() else 1.0
        if self.topo.all_reduce_max(finite) > 0:
            raise TrainingError(
                f"refusing to checkpoint at step {step}: the weights are not "
                "finite; the previous checkpoint is kept"
            )
        meta = {
            "step": step,
            "tokens": tokens,
            "skipped_steps": skipped,
            "loader": loader.state_dict(),
            "wandb_run_id": self._wandb_id,
            "world_size": self.topo.world_size,
            "backend": self.backend_name,
            "model_config": model_cfg.to_dict(),
            "config": relocatable(self.cfg).to_dict(),
            # The run folder relative to the checkpoint root (or absolute): eval finds the
            # run's own data beside a copied or moved checkpoint (train/run_paths.py).
            "run_dir": record_run_dir(self.run_dir, mgr.root),
            "tokenizer": getattr(self, "_tokenizer_identity", None),
            "initial_load": self._initial_load_uri,  # the weights step 0 started from
        }
        rank_state = {"rng": capture_rng_state(), "loader": loader.state_dict()}
        uri = backend.save(mgr, step, meta, rank_state, getattr(self, "_ckpt_files", {}))
        self.log(f"step {step}: checkpoint {uri}")
        self._emit({"event": "checkpoint", "checkpoint": uri}, step, tokens)
        return uri

    def _restore(
        self, mgr, uri: str, backend: _Backend, loader, model_cfg
    ) -> tuple[int, int, int, str | None]:
        # Check the model shape from the manifest before DCP tries (and fails less clearly).
        # From the manifest wherever it is (an explicit --resume URI may be another run's).
        check_model_compatible(mgr.read_meta(uri).get("model_config"), model_cfg, uri)
        ck = backend.load(mgr, uri)
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
        if not self.eval_only:
            for line in changed_settings(meta.get("config"), self.cfg.to_dict()):
                self.log(f"warning: resuming with a changed setting: {line}")
        return (
            int(meta["step"]),
            int(meta["tokens"]),
            int(meta.get("skipped_steps", 0)),
            meta.get("wandb_run_id"),
        )

    _initial_load_uri: str | None = None

    def _initial_load_source(self, model_cfg):
        """The checkpoint `checkpoint.initial_load` names, checked against this run's model
        (family and shape) from its manifest or config, before any tensor is read."""
        from gpn_scale.eval.load import read_source, resolve

        ref = str(self.cfg.checkpoint.initial_load)
        try:
            kind, uri = resolve(ref)
            source = read_source(kind, uri)
        except ConfigError as err:
            raise ConfigError(f"checkpoint.initial_load: {err}") from None
        saved = source.meta.get("model_config")
        if not isinstance(saved, dict):
            raise ConfigError(
                f"checkpoint.initial_load {uri}: no model config recorded with it (a "
                "model_final.pt needs its run's config.yaml beside it) to check against "
                f"model={self.cfg.model}; give a step directory or an export"
            )
        check_model_compatible(saved, model_cfg, uri, use="checkpoint.initial_load")
        if not self.cfg.checkpoint.initial_load_model_only and (
            kind != "dcp" or self.backend_name == "deepspeed"
        ):
            raise ConfigError(
                f"checkpoint.initial_load_model_only=false: the optimizer state is read from a "
                f"DCP step directory under parallel.backend none / fsdp2 ({uri} is a {kind} "
                f"checkpoint, backend {self.backend_name}); set initial_load_model_only=true"
            )
        self._initial_load_uri = uri
        return source

    def _load_initial_weights(self, model, source, spec, model_cfg) -> None:
        """Collective for a DCP source: every rank reads the full weights (DCP reassembles
        any dp/tp layout) into the unsharded model, which the backend then shards."""
        from gpn_scale.checkpoint import CheckpointError, CheckpointManager

        if source.kind == "dcp":
            state = model.state_dict()
            try:
                CheckpointManager(source.uri.rstrip("/").rsplit("/", 1)[0]).load(
                    source.uri, {"model": state}
                )
            except CheckpointError as err:
                if "it is a deepspeed checkpoint" in str(err):
                    raise ConfigError(
                        f"checkpoint.initial_load {source.uri} is a DeepSpeed checkpoint; give "
                        "its run's model_final.pt (checkpoint.export_final) or a DCP checkpoint"
                    ) from None
                raise
        elif source.kind == "export":
            from gpn_scale.eval.export_format import read_export_weights

            state = read_export_weights(source.uri, spec, model_cfg)
        else:
            from gpn_scale.eval.load import _weights_from_final

            state = _weights_from_final(source.uri)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise ConfigError(
                f"checkpoint.initial_load {source.uri}: its weights do not fit model="
                f"{self.cfg.model} ({str(err).strip().splitlines()[0][:160]})"
            ) from None

    def _check_same_data(self, meta: dict, uri: str) -> None:
        """A checkpoint read with data tokenized otherwise is refused (its ids would mean
        other text); held-out eval on another dataset of the same tokenizer says so."""
        from gpn_scale.eval.load import describe_tokenizer, same_tokenizer

        recorded, ours = meta.get("tokenizer"), getattr(self, "_tokenizer_identity", None)
        if isinstance(recorded, dict) and ours and not same_tokenizer(recorded, ours):
            raise ConfigError(
                f"data.remote {self._remote} is tokenized with {describe_tokenizer(ours)}, but "
                f"checkpoint {uri} was trained with {describe_tokenizer(recorded)}; point "
                "data.remote at data built with the checkpoint's tokenizer"
            )
        saved = (meta.get("loader") or {}).get("dataset")
        fingerprint = getattr(self, "_data_fingerprint", None)
        if self.eval_only and saved and fingerprint and saved != fingerprint:
            self.log(
                f"eval: warning: data.remote {self._remote} is not the dataset {uri} was "
                f"trained on (fingerprint {fingerprint} != {saved}); evaluating on it"
            )

    def _restore_newest(
        self, mgr, uri: str, backend: _Backend, loader, model_cfg
    ) -> tuple[str, tuple[int, int, int, str | None]]:
        """`eval --checkpoint auto` beside a live run: the newest complete checkpoint now
        (the run may have saved since the start), loaded whole before anything uses it; if
        the run's retention deletes it meanwhile, the newest one then (a few tries)."""
        from gpn_scale.checkpoint import CheckpointError

        for attempt in range(4):
            uri = mgr.latest() or uri
            try:
                return uri, self._restore(mgr, uri, backend, loader, model_cfg)
            except CheckpointError:
                if attempt == 3 or mgr.is_complete(uri):
                    raise
                self.log(f"eval: {uri} was deleted while loading (retention); trying the newest")
        raise AssertionError("unreachable")

    _wandb_id: str | None = None
    _sinks: list = []

    def _open_sinks(
        self, resume_step: int | None, wandb_id: str | None, model_cfg, n_params: int
    ) -> None:
        self._sinks = []
        self._wandb_id = wandb_id  # kept in later checkpoints even if W&B is off this time
        if not self.topo.is_main:
            return
        from gpn_scale.train.metrics import JsonlSink, scrub_secrets

        run_dir = Path(self.run_dir)
        # Resolved (defaults filled in, the derived paths written out) and relocatable: paths
        # inside the run folder relative to it, so a copied folder reads its own files.
        from gpn_scale.train.run_paths import RUN_CONFIG, relocatable

        (run_dir / RUN_CONFIG).write_text(to_yaml(relocatable(self.cfg)))
        self._sinks.append(JsonlSink(str(run_dir / "metrics.jsonl"), resume_step=resume_step))
        wb = self.cfg.logging.wandb
        if wb.mode != "disabled":
            from gpn_scale.train.metrics import WandbSink

            config = scrub_secrets(
                {**self.cfg.to_dict(), "model_config": model_cfg.to_dict(), "params": n_params}
            )

            def open_wandb(mode: str) -> WandbSink:
                return WandbSink(
                    project=wb.project,
                    entity=wb.entity,
                    group=wb.group,
                    job_type=wb.job_type,
                    name=self.cfg.run_name,
                    config=config,
                    mode=mode,
                    dir=wb.dir or str(run_dir),
                    resume_id=wandb_id or wb.run_id,
                    init_timeout=wb.init_timeout,
                    log=self.log,
                )

            mode = wb.mode
            if mode == "auto":
                from gpn_scale.train.metrics import wandb_server_reachable

                reachable, base_url = wandb_server_reachable(min(wb.init_timeout, 10.0))
                mode = "online" if reachable else "offline"
                if not reachable:  # compute nodes often have no internet
                    self.log(
                        f"W&B: {base_url} not reachable; logging.wandb.mode=auto: offline instead"
                    )
            try:
                sink = open_wandb(mode)
            except ConfigError as err:
                if wb.mode != "auto" or mode != "online":
                    raise
                # compute nodes often have no internet: log offline, upload from a login node
                self.log(f"W&B: online failed ({err}); logging.wandb.mode=auto: offline instead")
                import wandb

                wandb.teardown()  # else the failed online attempt still holds the run id
                sink = open_wandb("offline")
            if sink.offline:
                self.log(
                    f"W&B: offline run {sink.run_id} in {sink.dir}; upload it with "
                    f"`wandb sync {Path(sink.dir).parent}`"
                )
            self._wandb_id = sink.run_id
            self._sinks.append(sink)

    def _emit(self, metrics: dict[str, Any], step: int, tokens: int) -> None:
        for sink in self._sinks:
            sink.log({"tokens": tokens, **metrics}, step=step)


def _tokenizer_record(identity: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(the tokenizer identity every checkpoint records, the files it carries): a Hugging
    Face tokenizer's tokenizer.json travels in each step directory (checked against the
    dataset's sha256), so eval, generation and export need neither the training data nor
    the file at its recorded path (a relative one is made absolute while it resolves)."""
    identity = dict(identity)
    if identity.get("kind") != "huggingface":
        return identity, {}
    name = str(identity.get("name") or "")
    if name and not os.path.isabs(name) and os.path.exists(os.path.expanduser(name)):
        identity["name"] = os.path.abspath(os.path.expanduser(name))
    from gpn_scale.eval.tokenizer import from_identity

    try:
        text = from_identity(identity, where="the training data's tokenizer").serialized()
    except ConfigError:  # not at hand here: the identity alone (the data is tokenized)
        return identity, {}
    from gpn_scale.eval.load import TOKENIZER_FILE

    return identity, ({TOKENIZER_FILE: text.encode()} if text else {})


def progress_line(
    step: int,
    total: int,
    loss: float,
    lr: float,
    tokens_per_s: float,
    mfu: float | None,
    s_per_step: float,
) -> str:
    """The plain progress line written instead of the tqdm bar when stderr is no terminal
    (a SLURM log, a pipe), led by the wall-clock time (ISO 8601, local time with its UTC
    offset: one format whatever the locale, sortable, and comparable across nodes)."""
    eta = int(round(s_per_step * (total - step)))
    return (
        f"{timestamp()} step {step}/{total} | loss {loss:.4f} | lr {lr:.3e} | "
        f"{tokens_per_s:,.0f} tok/s"
        f" | MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}"
        f" | ETA {eta // 3600}:{eta % 3600 // 60:02d}:{eta % 60:02d}"
    )


def timestamp() -> str:
    """Now, as 2025-01-31T14:05:09+01:00 (seconds; the offset names the zone)."""
    import datetime as dt

    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def run_summary(
    steps: int, wall_s: float, mean_tokens_per_s: float | None, mean_mfu: float | None
) -> str:
    """The end-of-run line: steps trained by this process, their wall time, and the mean
    tokens/s and MFU per step (the first step, which builds the kernels, left out when
    there are others)."""
    tps = "n/a" if mean_tokens_per_s is None else f"{mean_tokens_per_s:,.0f}"
    mfu = "n/a" if mean_mfu is None else f"{100 * mean_mfu:.1f}%"
    return (
        f"summary: {steps} step(s) in {_clock(wall_s)} wall time | mean {tps} tok/s | "
        f"mean MFU {mfu}"
    )


class FirstStepNotice:
    """On a GPU, one line when the first step of a process is still running after `after_s`
    seconds: Triton compiles the kernels it launches there (cached for later runs), which
    can take a minute or more, and a silent `step 1` looks like a hang. (On a CPU the fused
    step kernels say so themselves before they compile: gpn_scale/ops/step_kernels.py.)
    GPN_SCALE_SLOW_STEP_S sets the wait (default 20 s)."""

    def __init__(
        self, log: Callable[[str], None], device_type: str, step: int, after_s: float | None = None
    ) -> None:
        import threading

        self._timer: Any = None
        if device_type != "cuda":
            return
        if after_s is None:
            after_s = float(os.environ.get("GPN_SCALE_SLOW_STEP_S", "20"))
        cache = os.environ.get("TRITON_CACHE_DIR") or "~/.triton/cache"
        self._message = (
            f"step {step} is still running after {after_s:g}s: the first step on a GPU "
            f"compiles its Triton kernels (once; cached in {cache}, later runs start at once)"
        )
        self._log = log
        self._timer = threading.Timer(after_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self._log(self._message)

    def done(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _no_resume(resume: str) -> bool:
    """The spellings of --resume none (CheckpointManager.resolve_resume accepts the same)."""
    return resume.strip().lower() in ("none", "never", "no", "false", "off", "")


def _missing_tops(paths: list[str | None]) -> list[Path]:
    """For each local path, its topmost ancestor that does not exist yet (what creating it
    would add); nothing for paths that exist, S3 URIs and None."""
    out: list[Path] = []
    for path in paths:
        if not path or "://" in str(path):
            continue
        p = Path(os.path.abspath(os.path.expanduser(str(path))))
        top = None
        while not p.exists() and p != p.parent:
            top, p = p, p.parent
        if top is not None and top not in out:
            out.append(top)
    return out


# Settings whose change on resume alters the run that was checkpointed (the schedule or
# the optimiser); allowed (e.g. extending total_steps), but never silently.
RESUME_WATCHED = ("schedule", "optim")


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
