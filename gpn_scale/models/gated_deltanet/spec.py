"""Gated DeltaNet as a registered family (gpn_scale/models/registry.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpn_scale.models.gated_deltanet.config import SHAPE_KEYS, GatedDeltaNetConfig
from gpn_scale.models.protocol import FamilySpec

if TYPE_CHECKING:  # loading a config resolves the family without importing torch
    from torch import nn


def _build(cfg: GatedDeltaNetConfig) -> nn.Module:
    from gpn_scale.models.gated_deltanet.model import GatedDeltaNet

    return GatedDeltaNet(cfg)


def _count_parameters(cfg: GatedDeltaNetConfig) -> int:
    from gpn_scale.models.gated_deltanet.counts import count_parameters

    return count_parameters(cfg)


def _flops_per_token(cfg: GatedDeltaNetConfig, seq_len: int) -> float:
    from gpn_scale.models.gated_deltanet.counts import flops_per_token

    return flops_per_token(cfg, seq_len)


def _blocks(model: nn.Module) -> list[nn.Module]:
    # One FSDP2 unit, and one compiled region, per block (each block's forward runs its own
    # parameters); the embedding, final norm and head stay with the root unit the caller
    # wraps last, uncompiled.
    return list(model.layers)  # type: ignore[arg-type]


def _apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    from gpn_scale.models.gated_deltanet.parallelize import apply_tp

    apply_tp(model, tp_mesh)


def _check_tp(cfg: GatedDeltaNetConfig, tp: int) -> None:
    from gpn_scale.models.gated_deltanet.parallelize import check_tp

    check_tp(cfg, tp)


def _check_device(cfg: GatedDeltaNetConfig, device_type: str) -> None:
    """The gated-delta-rule backend (`backend`, or GPN_SCALE_GDN_BACKEND over it) must be one
    that runs on this device: refused here, not at the first step."""
    import os

    import torch

    from gpn_scale.core.config import ConfigError
    from gpn_scale.ops import gated_delta_rule as gdr

    try:
        gdr.select(cfg.backend, torch.device(device_type))
    except gdr.GatedDeltaRuleError as err:
        msg = str(err)
        if not msg.startswith(("backend=", gdr.ENV_VAR)):  # name where the choice came from
            env = os.environ.get(gdr.ENV_VAR, "").strip()
            msg = f"{f'{gdr.ENV_VAR}={env}' if env else f'backend={cfg.backend}'}: {msg}"
        raise ConfigError(msg) from None


def _compat_keys(cfg: GatedDeltaNetConfig) -> dict[str, Any]:
    values = cfg.to_dict()
    return {"family": GatedDeltaNetConfig.family_name, **{k: values[k] for k in SHAPE_KEYS}}


SPEC = FamilySpec(
    name=GatedDeltaNetConfig.family_name,
    config_from_dict=GatedDeltaNetConfig.from_dict,
    build=_build,
    count_parameters=_count_parameters,
    flops_per_token=_flops_per_token,
    fsdp_units=_blocks,
    compat_keys=_compat_keys,
    recurrent=True,
    apply_tp=_apply_tp,  # heads split (parallelize.py); residual norms, embedding, head on dp
    check_tp=_check_tp,
    check_device=_check_device,
    # compile.enable: one torch.compile per block, not required to be one graph: on CUDA
    # fla's chunk_gated_delta_rule is @torch.compiler.disable (fla 0.6.0,
    # ops/gated_delta_rule/chunk.py), which fullgraph=True refuses ("Skip calling
    # torch.compiler.disable()d function"), so there each block compiles in two pieces around
    # it. Our chunkwise op (CPU, and CUDA without fla) traces whole, its chunk loop unrolled,
    # at tp 1 and 2 alike, to the eager losses (tests/parallel/test_compile.py). The graph
    # grows with the chunks per window: the tiny model's first step compiles for ~35 s at
    # chunk_size 32 and 40-65 s at its 16 (T = 64, one CPU thread).
    compile_blocks=_blocks,
    compile_fullgraph=False,
    description=(
        "Gated DeltaNet (Yang et al.): gated delta-rule memory per layer, short convolutions, "
        "output gate and norm, SwiGLU MLP; fla's kernels on CUDA, our chunkwise op elsewhere"
    ),
    title="Gated DeltaNet",
)
