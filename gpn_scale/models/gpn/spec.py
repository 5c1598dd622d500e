"""GPN / GPN+M as a registered family (gpn_scale/models/registry.py)."""

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
    description="GPN / GPN+M: one wide recurrent state, one FFN, one shared gated-delta memory",
)
