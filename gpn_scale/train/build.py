"""The model a run trains, built from its config: the family's module on the device, the
warm-start weights, then the parallelism and the optimizer (parallel/train_module.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpn_scale import optim as optim_lib
from gpn_scale.parallel.topology import Topology
from gpn_scale.parallel.train_module import ParallelPlan, TrainModule, build_train_module
from gpn_scale.run.config import TrainConfig
from gpn_scale.train.checkpointing import RunCheckpoints
from gpn_scale.train.determinism import seed_everything


def training_flops_per_token(model_cfg: Any, seq_len: int) -> float:
    """The model's own training FLOPs/token (forward + backward), from its family's spec."""
    from gpn_scale.models.registry import family_of

    return float(family_of(model_cfg).flops_per_token(model_cfg, seq_len))


def parallel_plan(
    cfg: TrainConfig, strategy: str, micro: int, accum: int, bf16: bool
) -> ParallelPlan:
    return ParallelPlan(
        strategy=strategy,
        micro_batch=micro,
        accum=accum,
        global_batch=cfg.train.global_batch_size,
        grad_clip=cfg.optim.grad_clip,
        bf16=bf16,
        zero_stage=cfg.parallel.zero_stage,
        zero3_persistence_threshold=cfg.parallel.zero3_persistence_threshold,
        reduce_dtype=cfg.parallel.reduce_dtype,
        reshard_after_forward=cfg.parallel.reshard_after_forward,
        compile=cfg.compile.enable,
    )


def build_model(
    cfg: TrainConfig,
    model_cfg: Any,
    topo: Topology,
    strategy: str,
    bf16: bool,
    micro: int,
    accum: int,
    warm: Any,
    ckpt: RunCheckpoints,
    log: Callable[[str], None],
) -> tuple[TrainModule, int]:
    """(the train module: the built model under its sharding strategy with its optimizer;
    the model's size)."""
    from gpn_scale.models.registry import family_of

    # Same seed on every rank: identical initial weights before any sharding.
    seed_everything(cfg.seed)
    spec = family_of(model_cfg)
    model = spec.build(model_cfg).to(topo.device)
    if warm is not None and cfg.checkpoint.initial_load_model_only:
        ckpt.load_initial_weights(model, warm, spec, model_cfg)  # before any sharding
    n_params = sum(p.numel() for p in model.parameters())
    o = cfg.optim
    fused = o.fused and topo.device.type == "cuda"
    train_module = build_train_module(
        model,
        parallel_plan(cfg, strategy, micro, accum, bf16),
        topo,
        make_optimizer=lambda m: optim_lib.build_adamw(
            m, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay, fused=fused
        ),
        fsdp_units=spec.fsdp_units(model),
        apply_tp=spec.apply_tp,
        # model_config refused compile.enable for a family without blocks (run/model.py)
        compile_blocks=spec.compile_blocks(model) if spec.compile_blocks else (),
        compile_fullgraph=spec.compile_fullgraph,
        log=log,
    )
    train_module.train(True)
    if warm is not None:
        ckpt.load_initial_optimizer(train_module, warm)
    return train_module, n_params
