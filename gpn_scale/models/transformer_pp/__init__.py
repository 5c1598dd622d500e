"""Transformer++ (LLaMA-style): config, model, counts, tensor-parallel plan, the Hugging
Face mapping; its FamilySpec is `spec.py` (gpn_scale/models/registry.py loads it)."""

from gpn_scale.models.transformer_pp.config import TransformerPPConfig

__all__ = ["TransformerPPConfig"]
