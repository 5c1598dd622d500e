"""Transformer++ (LLaMA-style) as a registered family (gpn_scale/models/registry.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpn_scale.models.protocol import FamilySpec
from gpn_scale.models.transformer_pp.config import TransformerPPConfig

if TYPE_CHECKING:  # loading a config resolves the family without importing torch
    from torch import nn

# The fields a checkpoint must share with the config that resumes it (the weights' shapes).
SHAPE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ffn", "tie_embeddings")


def _build(cfg: TransformerPPConfig) -> nn.Module:
    from gpn_scale.models.transformer_pp.model import TransformerPP

    return TransformerPP(cfg)


def _count_parameters(cfg: TransformerPPConfig) -> int:
    from gpn_scale.models.transformer_pp.counts import count_parameters

    return count_parameters(cfg)


def _flops_per_token(cfg: TransformerPPConfig, seq_len: int) -> float:
    from gpn_scale.models.transformer_pp.counts import flops_per_token

    return flops_per_token(cfg, seq_len)


def _check_tp(cfg: TransformerPPConfig, tp: int) -> None:
    from gpn_scale.models.transformer_pp.parallelize import check_tp

    check_tp(cfg, tp)


def _apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    from gpn_scale.models.transformer_pp.parallelize import apply_tp

    apply_tp(model, tp_mesh)


def _compat_keys(cfg: TransformerPPConfig) -> dict[str, Any]:
    return {"family": cfg.family_name, **{k: getattr(cfg, k) for k in SHAPE_KEYS}}


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.layers)  # type: ignore[arg-type]


def _hf_adapter() -> Any:
    """Our names <-> LlamaForCausalLM's (the same network): `gpn-scale export --format hf`."""
    from gpn_scale.models.transformer_pp import hf

    return hf


SPEC = FamilySpec(
    name=TransformerPPConfig.family_name,
    config_from_dict=TransformerPPConfig.from_dict,
    build=_build,
    count_parameters=_count_parameters,
    flops_per_token=_flops_per_token,
    fsdp_units=_blocks,  # one FSDP2 unit per block
    compat_keys=_compat_keys,
    recurrent=False,
    # Megatron's block split (parallelize.py); the norms, embedding and head stay plain
    # parameters, so under FSDP2 they live on the dp mesh and the blocks on dp x tp (the
    # gradient norm and clipping go mesh by mesh: gpn_scale/optim.py).
    apply_tp=_apply_tp,
    check_tp=_check_tp,
    # compile.enable: one torch.compile per block, as one graph (torchtitan's fullgraph=True:
    # attention is SDPA, the rest plain torch ops, at tp 1 and 2 alike; the first step
    # compiles, ~20 s for the tiny model on one CPU thread).
    compile_blocks=_blocks,
    compile_fullgraph=True,
    description="Transformer++: LLaMA-style decoder (pre-RMSNorm, RoPE, SwiGLU, no biases)",
    title="Transformer++",
    hf_adapter=_hf_adapter,
)
