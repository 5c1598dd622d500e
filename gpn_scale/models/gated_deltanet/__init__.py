"""Gated DeltaNet: config, model, counts, tensor-parallel plan; its FamilySpec is
`spec.py` (gpn_scale/models/registry.py loads it)."""

from gpn_scale.models.gated_deltanet.config import GatedDeltaNetConfig

__all__ = ["GatedDeltaNetConfig"]
