"""DeepSpeed ZeRO (stages 1-3) as a sharding strategy: our config mapped onto a DeepSpeed config.

What maps where:
  train.global_batch_size / micro batch / accumulation -> train_batch_size,
      train_micro_batch_size_per_gpu, gradient_accumulation_steps
  optim.grad_clip     -> gradient_clipping (DeepSpeed clips on the global norm)
  precision bf16      -> torch_autocast (bf16 matmuls), NOT bf16.enabled: DeepSpeed's bf16
      mode casts every parameter to bf16 (A_log, dt_bias, the norms and biases too),
      accumulates gradients in bf16 and switches off the loop's autocast inside its
      forward. With torch_autocast the parameters, gradients (grad_accum_dtype fp32) and
      their reduction stay fp32 (no module is "lower-precision safe", so no bf16 comm), which
      is FSDP2's recipe: both strategies train the same model.
  parallel.zero_stage -> zero_optimization.stage
The optimizer is OUR AdamW (same parameter groups, `optim.build_adamw`), handed to
DeepSpeed as a client optimizer, and the learning rate is set on its param groups by the
loop each step, exactly as for the other strategies. DeepSpeed's ZeRO optimizer checks the
gradients for inf/NaN and skips the step by itself; the loop reads that back.

ZeRO-3 gathers a module's partitioned parameters in that module's forward pre-hook. The
GPN forward reads its submodules' parameters directly (one autograd engine, submodule
forwards never run), so every parameter is registered as an *external* parameter of the
root module: the root's hook then gathers all of them for the forward and backward.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[2]


def prepare_env() -> None:
    """Set before `import deepspeed`: CPU accelerator off-GPU, a persistent op-build cache."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed JIT-builds a comm op on CPU (~60 s once); keep it in the repo's git-ignored cache.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".cache" / "torch_extensions"))


def init_distributed(backend: str) -> None:
    prepare_env()
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def ds_config(
    *,
    global_batch: int,
    micro_batch: int,
    accum: int,
    grad_clip: float,
    zero_stage: int,
    bf16: bool,
    persistence_threshold: int | None = None,
) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage == 3 and persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = int(persistence_threshold)
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": float(grad_clip) if grad_clip > 0 else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": False},  # see the module docstring: bf16 is torch_autocast here
        "fp16": {"enabled": False},
        "torch_autocast": {
            "enabled": bool(bf16),
            "dtype": "bfloat16",
            "lower_precision_safe_modules": [],
        },
        "data_types": {"grad_accum_dtype": "fp32"},
        # Our AdamW (torch) as the client optimizer: DeepSpeed calls it "untested" for ZeRO.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def register_root_externals(model: nn.Module) -> None:
    """ZeRO-3: make the root's forward gather every parameter (see module docstring)."""
    import deepspeed

    for module in model.modules():
        if module is model:
            continue
        for p in module.parameters(recurse=False):
            deepspeed.zero.register_external_parameter(model, p)


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any]):
    """deepspeed.initialize -> engine (engine.module is the model, engine.optimizer ZeRO's)."""
    import deepspeed

    if config["zero_optimization"]["stage"] == 3:
        register_root_externals(model)
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config
    )
    return engine, ds_optimizer


def step_was_skipped(engine) -> bool:
    """True when ZeRO found non-finite gradients and skipped the last optimizer step."""
    return bool(getattr(engine.optimizer, "overflow", False))


def local_params(engine) -> list[torch.Tensor]:
    """This rank's share of the weights (ZeRO-3 partitions live in `ds_tensor`)."""
    return [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
