"""GPN / GPN+M as a registered family (gpn_scale/models/registry.py): what the trainer, eval,
`gpn-scale info`, sweeps and fits ask of it instead of its name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpn_scale.models.gpn.config import GPNConfig
from gpn_scale.models.protocol import FamilySpec

if TYPE_CHECKING:  # loading a config resolves the family without importing torch
    from torch import nn

# The fields a checkpoint must share with the config that resumes it (the model's shape).
SHAPE_KEYS = (
    "vocab_size",
    "d_state",
    "d_emb",
    "d_ffn",
    "n_layers",
    "memory",
    "n_heads",
    "d_key",
    "d_value",
    "decoder_bias",
)


def _build(cfg: GPNConfig) -> nn.Module:
    from gpn_scale.models.gpn.gpn import GPN

    return GPN(cfg)


def _count_parameters(cfg: GPNConfig) -> int:
    from gpn_scale.models.gpn.counts import count_parameters

    return count_parameters(cfg)


def _flops_per_token(cfg: GPNConfig, seq_len: int) -> float:
    from gpn_scale.models.gpn.counts import flops_per_token

    return flops_per_token(cfg, seq_len)


def _compat_keys(cfg: GPNConfig) -> dict[str, Any]:
    values = cfg.to_dict()
    return {"family": GPNConfig.family_name, **{k: values[k] for k in SHAPE_KEYS}}


def _apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    from gpn_scale.models.gpn.parallelize import apply_tp

    apply_tp(model, tp_mesh)


def _check_tp(cfg: GPNConfig, tp: int) -> None:
    from gpn_scale.models.gpn.parallelize import check_tp

    check_tp(cfg, tp)


def _with_tbptt(cfg: GPNConfig, tbptt: int) -> GPNConfig:
    """`train.tbptt` over the model file's (the run's schema checked it is >= 0)."""
    return cfg.replace(tbptt=tbptt)


def _with_engine(cfg: GPNConfig, given: dict[str, Any]) -> GPNConfig:
    """The run's `engine:` options over the model file's, an error named engine.<key>."""
    from gpn_scale.ops.gpn_step.options import EngineOptions

    options = EngineOptions.from_dict({**cfg.engine.to_dict(), **given}, prefix="engine.")
    return cfg.replace(engine=options)


def _for_inference(cfg: GPNConfig) -> GPNConfig:
    """The exact model: reads of the memory in bf16 are a training-speed option."""
    return cfg.replace(bf16_memory_reads=False)


def _info(cfg: GPNConfig, name: str, batch_size: int, seq_len: int) -> list[tuple[str, str]]:
    """`gpn-scale info`: the counts, memory cells and a training-memory estimate."""
    from gpn_scale.models.gpn.counts import (
        count_parameters,
        estimate_training_memory,
        flops_per_token,
        forward_flops_per_token,
        non_embedding_parameters,
    )

    mem = estimate_training_memory(cfg, batch_size, seq_len)
    gib = 1024**3
    return [
        ("model", f"{name} ({cfg.family}, {cfg.n_layers} layer(s))"),
        (
            "shape",
            f"V={cfg.vocab_size} d={cfg.d_state} e={cfg.d_emb} f={cfg.d_ffn}"
            + (f" H={cfg.n_heads} dk={cfg.d_key} dv={cfg.d_value}" if cfg.memory else ""),
        ),
        ("parameters", f"{count_parameters(cfg):,}"),
        ("non-embedding parameters", f"{non_embedding_parameters(cfg):,}"),
        ("memory cells", f"{cfg.cells:,}"),
        ("forward FLOPs/token", f"{forward_flops_per_token(cfg):.4g}"),
        ("training FLOPs/token", f"{flops_per_token(cfg, seq_len):.4g}"),
        (
            f"training memory (B={batch_size}, T={seq_len}, fp32 + AdamW)",
            f"{mem.total_bytes / gib:.2f} GiB = weights {mem.parameters_bytes / gib:.2f} "
            "+ grads/AdamW "
            f"{mem.training_state_bytes / gib:.2f} + activations {mem.activations_bytes / gib:.2f}",
        ),
    ]


SPEC = FamilySpec(
    name=GPNConfig.family_name,
    config_from_dict=GPNConfig.from_dict,
    build=_build,
    count_parameters=_count_parameters,
    flops_per_token=_flops_per_token,
    # The forward reads every submodule's parameters directly (engine.py folds them), so FSDP2 must
    # treat the whole model as one unit.
    fsdp_units=lambda model: [],
    compat_keys=_compat_keys,
    recurrent=True,
    apply_tp=_apply_tp,
    check_tp=_check_tp,
    # Not compiled: the forward is one custom autograd engine over the whole sequence whose
    # steps run our own kernels (fused C++ on CPU, Triton + CUDA graphs on GPU), with no
    # repeated block module for torch.compile to trace; compile.enable=true is refused
    # for this family in one line (gpn_scale/run/model.py, docs/families.md says why).
    compile_blocks=None,
    not_compiled="whose sequence engine runs its own kernels and is not compiled",
    description="GPN / GPN+M: one wide recurrent state, one FFN, one shared gated-delta memory",
    title="GPN",
    # train.tbptt truncates its recurrence; the run's engine: section says how the engine
    # runs the sequence (ops/gpn_step/options.py), never what it computes (bf16_memory_reads
    # aside, which `for_inference` turns off).
    run_options={"tbptt": _with_tbptt, "engine": _with_engine},
    hf_adapter=None,  # no Hugging Face architecture runs GPN: --format safetensors only
    info=_info,
    for_inference=_for_inference,
    # The paper's claim is about a 1-layer predictor: 2-layer GPN+M is a curve of its own.
    depth_is_variant=True,
    launch_accounting=True,  # gpn_scale/accounting dry-runs its engine's CUDA step
    state_analyses=True,  # gpn-scale analyze, analysis.every_steps (eval/analysis/)
)
