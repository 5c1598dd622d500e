"""The train module the trainer drives: the model under its sharding strategy, with its
optimizer. The strategies (`parallel.backend` in the config): none (one process), FSDP2 and
DeepSpeed ZeRO.

`setup_topology` starts the process group a strategy needs; `build_train_module` applies the
parallelism to a built model in torchtitan's fixed order (tensor parallelism, activation
checkpointing (none yet), torch.compile of each block (`compile.enable`, parallel/compile.py),
then FSDP2 over the data-parallel mesh of the same parent mesh, or DeepSpeed ZeRO), builds
the optimizer once, and returns one `TrainModule` (OLMo-core's name for it: forward and loss,
backward, clip and step, state dicts). Everything that differs between the strategies is
behind that protocol: the training loop never asks which one it has.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from gpn_scale import optim as optim_lib
from gpn_scale.core.config import ConfigError
from gpn_scale.core.env import DistEnv, export_for_torch
from gpn_scale.parallel.topology import Topology, free_port, init_topology, rank_device

STRATEGIES = ("none", "fsdp2", "deepspeed")


class TrainModule(Protocol):
    """What the training loop needs from the model under its sharding strategy."""

    name: str
    model: nn.Module  # the (sharded) module; its forward is GPN's or a baseline's
    last_optim_s: float  # the last optimizer step's time (0 where an engine does it inside)

    def before_step(self, lr: float) -> None:
        """Called once per step before its first micro-batch."""

    def forward_loss(
        self, tokens: torch.Tensor, state: Any = None, want_state: bool = False
    ) -> tuple[torch.Tensor, Any]: ...

    def backward(self, loss: torch.Tensor, accum: int, last_micro: bool) -> None: ...

    def clip_and_step(self, grad_clip: float, lr: float, loss_finite: bool) -> tuple[float, bool]:
        """(grad norm, applied): the update is skipped when the norm or the loss is not finite."""
        ...

    def weights_finite(self) -> bool: ...

    def eval_forward(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Collective: the unsharded weights on rank 0 (None elsewhere)."""
        ...

    def train(self, mode: bool) -> None: ...

    def save(self, mgr: Any, step: int, meta: dict, rank_state: dict, files: dict) -> str: ...

    def load(self, mgr: Any, uri: str) -> Any: ...


@dataclass(frozen=True)
class ParallelPlan:
    """How to run one model: the sharding strategy and what it needs to know of the batch."""

    strategy: str  # none | fsdp2 | deepspeed (resolved: not "auto")
    micro_batch: int  # per data-parallel rank
    accum: int  # micro-batches per optimizer step
    global_batch: int
    grad_clip: float
    bf16: bool  # autocast compute; weights, gradients and their reduction stay fp32
    zero_stage: int = 2
    zero3_persistence_threshold: int | None = None
    reduce_dtype: str = "fp32"
    reshard_after_forward: bool = True
    compile: bool = False  # torch.compile each of the family's blocks (compile.enable)


# --------------------------------------------------------------------------- topology
def resolve_strategy(requested: str, distributed: bool) -> str:
    """The sharding strategy of parallel.backend: "auto" is fsdp2 under a launcher, none in
    one process."""
    strategy = requested
    if strategy == "auto":
        strategy = "fsdp2" if distributed else "none"
    if strategy == "none" and distributed:
        raise ConfigError(
            "parallel.backend: none cannot run on several processes; use fsdp2 or deepspeed"
        )
    return strategy


def setup_topology(env: DistEnv, strategy: str, device: str, tp: int) -> Topology:
    """The process group and device mesh `strategy` runs on (`resolve_strategy`'s result)."""
    if (
        strategy in ("fsdp2", "deepspeed")
        and not env.distributed
        and "MASTER_PORT" not in os.environ
    ):
        env = dataclasses.replace(env, master_port=free_port())  # a 1-rank group's rendezvous
    # fully_shard needs a process group (without one it dies asking for RANK): one process
    # runs FSDP2 as a 1-rank group, so its checkpoints are those of any other world size.
    fsdp2_alone = strategy == "fsdp2" and not env.distributed
    if fsdp2_alone:
        print(
            "parallel.backend=fsdp2 in one process: running FSDP2 as a 1-rank group "
            "(launch with torchrun for data parallelism)",
            file=sys.stderr,
            flush=True,
        )
    if strategy == "deepspeed":  # DeepSpeed wants its process group even for one process
        from gpn_scale.parallel import deepspeed as ds

        export_for_torch(env)
        ds.init_distributed(
            "nccl" if rank_device(device, env.local_rank).type == "cuda" else "gloo"
        )
    return init_topology(env, device, tp=tp, group_for_one=fsdp2_alone)


# --------------------------------------------------------------------------- build
def build_train_module(
    model: nn.Module,
    plan: ParallelPlan,
    topo: Topology,
    *,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    fsdp_units: Sequence[nn.Module] = (),
    apply_tp: Callable[[nn.Module, Any], Any] | None = None,
    compile_blocks: Sequence[nn.Module] = (),
    compile_fullgraph: bool = True,
    log: Callable[[str], None] = print,
) -> TrainModule:
    """Parallelize `model` (TP, then compile, then FSDP2 or DeepSpeed) and build its
    optimizer, once. `compile_blocks` / `compile_fullgraph`: the family's (FamilySpec), read
    when `plan.compile`."""
    if topo.tp_size > 1:  # TP first, then FSDP2 over "dp" of the same parent mesh
        if apply_tp is None:
            raise ConfigError(f"parallel.tp: {topo.tp_size}: this model has no tp plan; use tp 1")
        apply_tp(model, topo.tp_mesh)
    if plan.compile:  # after TP (the graph sees the shards), before FSDP2 / ZeRO wrap the blocks
        from gpn_scale.parallel.compile import apply_compile

        apply_compile(compile_blocks, compile_fullgraph, log)
    if plan.strategy == "deepspeed":
        return _deepspeed_train_module(model, plan, make_optimizer, log)
    if plan.strategy == "fsdp2":
        from gpn_scale.parallel.fsdp import apply_fsdp2

        # Compute dtype comes from autocast (bf16 on GPU), not from FSDP's param_dtype:
        # fp32 weights + autocast is what the model's fp32-state rule is written for
        # (bf16 param_dtype would halve the all-gathers; a later option).
        apply_fsdp2(
            model,
            topo.dp_mesh,
            units=fsdp_units,
            param_dtype=None,
            reduce_dtype=plan.reduce_dtype,
            reshard_after_forward=plan.reshard_after_forward,
        )
        return FSDP2TrainModule(model, make_optimizer(model))
    if plan.strategy != "none":
        raise ConfigError(
            f"parallel.backend: {plan.strategy!r} is not one of {', '.join(STRATEGIES)}"
        )
    return PlainTrainModule(model, make_optimizer(model))


def _deepspeed_train_module(
    model: nn.Module,
    plan: ParallelPlan,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    log: Callable[[str], None],
) -> DeepSpeedTrainModule:
    from gpn_scale.parallel import deepspeed as ds

    ds.prepare_env()
    ds_cfg = ds.ds_config(
        global_batch=plan.global_batch,
        micro_batch=plan.micro_batch,
        accum=plan.accum,
        grad_clip=plan.grad_clip,
        zero_stage=plan.zero_stage,
        bf16=plan.bf16,
        persistence_threshold=plan.zero3_persistence_threshold,
    )
    engine, ds_opt = ds.wrap(model, make_optimizer(model), ds_cfg)
    if plan.zero_stage == 3:
        params = list(engine.module.parameters())
        parts = sum(1 for p in params if getattr(p, "ds_tensor", p).numel() < p.ds_numel)
        log(f"deepspeed: ZeRO-3 partitions {parts} of {len(params)} parameters")
    return DeepSpeedTrainModule(engine, ds_opt)


# --------------------------------------------------------------------------- train modules
class PlainTrainModule:
    """One process, or the base of FSDP2: autograd, our clipping, our optimizer step."""

    name = "none"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.last_optim_s = 0.0

    def before_step(self, lr: float) -> None:
        pass  # the learning rate is set in clip_and_step, right before the update

    def forward_loss(
        self, tokens: torch.Tensor, state: Any = None, want_state: bool = False
    ) -> tuple[torch.Tensor, Any]:
        out = self.model(tokens, state=state, return_state=want_state)
        return out.loss, out.state

    def backward(self, loss: torch.Tensor, accum: int, last_micro: bool) -> None:
        (loss / accum).backward()

    def clip_and_step(self, grad_clip: float, lr: float, loss_finite: bool) -> tuple[float, bool]:
        norm_f = float(optim_lib.grad_norm_and_clip(self.model.parameters(), grad_clip))
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
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return None
        return {k: cast(torch.Tensor, v).detach().cpu().clone() for k, v in sd.items()}

    def train(self, mode: bool) -> None:
        self.model.train(mode)

    # Checkpoint plumbing (torch DCP via the CheckpointManager).
    def save(self, mgr: Any, step: int, meta: dict, rank_state: dict, files: dict) -> str:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        return mgr.save(
            step, {"model": msd, "optim": osd}, meta=meta, rank_state=rank_state, files=files
        )

    def load(self, mgr: Any, uri: str) -> Any:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        app_state: dict[str, Any] = {"model": msd, "optim": osd}
        ck = mgr.load(uri, app_state)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=app_state["model"],
            optim_state_dict=app_state["optim"],
        )
        return ck


class FSDP2TrainModule(PlainTrainModule):
    name = "fsdp2"

    def backward(self, loss: torch.Tensor, accum: int, last_micro: bool) -> None:
        # Reduce-scatter gradients only on the last micro-batch of an accumulation.
        self.model.set_requires_gradient_sync(last_micro)  # type: ignore[operator]
        (loss / accum).backward()


class DeepSpeedTrainModule:
    """The DeepSpeed engine clips, skips non-finite steps and steps the optimizer itself."""

    name = "deepspeed"

    def __init__(self, engine: Any, ds_optimizer: Any) -> None:
        self.engine, self.model, self.optimizer = engine, engine.module, ds_optimizer
        self.last_optim_s = 0.0

    def before_step(self, lr: float) -> None:
        optim_lib.set_lr(self.optimizer, lr)  # before engine.step() applies it

    def forward_loss(
        self, tokens: torch.Tensor, state: Any = None, want_state: bool = False
    ) -> tuple[torch.Tensor, Any]:
        out = self.engine(tokens, state=state, return_state=want_state)
        return out.loss, out.state

    def backward(self, loss: torch.Tensor, accum: int, last_micro: bool) -> None:
        self.engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
        self.engine.step()  # only steps at the accumulation boundary

    def clip_and_step(self, grad_clip: float, lr: float, loss_finite: bool) -> tuple[float, bool]:
        # DeepSpeed clipped and stepped (or skipped on inf/NaN) inside the last engine.step().
        from gpn_scale.parallel.deepspeed import step_was_skipped

        norm = self.engine.get_global_grad_norm()
        norm_f = float(norm) if norm is not None else float("nan")
        applied = not step_was_skipped(self.engine) and loss_finite and math.isfinite(norm_f)
        return norm_f, applied

    def weights_finite(self) -> bool:
        from gpn_scale.parallel.deepspeed import local_params

        return all(bool(torch.isfinite(p.detach()).all()) for p in local_params(self.engine))

    def eval_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.engine(tokens).loss

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        import deepspeed
        import torch.distributed as dist

        params = list(self.model.parameters())
        # ZeRO-3 partitions the weights; gathering is a no-op for stages 1-2 (full copies).
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            sd = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        return sd if dist.get_rank() == 0 else None

    def train(self, mode: bool) -> None:
        self.engine.train(mode)

    def save(self, mgr: Any, step: int, meta: dict, rank_state: dict, files: dict) -> str:
        return mgr.save_deepspeed(step, self.engine, meta=meta, rank_state=rank_state, files=files)

    def load(self, mgr: Any, uri: str) -> Any:
        return mgr.load_deepspeed(uri, self.engine)
