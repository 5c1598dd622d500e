"""A run's family label and counts, from its model config through the family registry.

Sweeps, the collector and the fits compare *labels*; this module is the one place that
defines them (docs/scaling.md, "Family labels"):

    label = base + depth
    base  = the config's variant label when its class has one (a string attribute `family`:
            GPN's "gpn+m" with the memory, "gpn" without), else the registry name
            ("transformer_pp", "gated_deltanet")
    depth = "-<n>l" when the family's depth is a variant (its FamilySpec's depth_is_variant)
            and the config has n_layers = n > 1, else ""

So a sweep over the paper's comparison has five labels: "gpn+m", "gpn+m-2l", "gpn",
"transformer_pp", "gated_deltanet". GPN's depth is part of the label because the paper's
claim is about a 1-layer predictor, so 1- and 2-layer GPN+M are different curves; a
Transformer's or GDN's depth grows along its ladder, so it is not. A sweep entry's
`family:` key still overrides the label (e.g. to split an ablation off a ladder).

Counts come from the family's FamilySpec (count_parameters, flops_per_token); nothing here
imports a family's modules beyond what the registry loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpn_scale.models.registry import family_of, load_model_config


def family_label(cfg: Any) -> str:
    """The label fits and sweeps use for a validated model config (rule: module docstring)."""
    spec = family_of(cfg)
    variant = getattr(cfg, "family", None)
    base = variant if isinstance(variant, str) and variant else spec.name
    layers = getattr(cfg, "n_layers", None)
    if spec.depth_is_variant and isinstance(layers, int) and layers > 1:
        base += f"-{layers}l"
    return base


@dataclass(frozen=True)
class ModelFacts:
    """What sweeps and fits need from a model config."""

    registry_name: str  # the FamilySpec's name ("gpn", "transformer_pp", ...)
    label: str  # family_label(cfg)
    config: Any  # the validated config (the family's own config class)
    params: int  # all parameters, embedding included
    flops_per_token: float  # training FLOPs per token (3 x forward) at `seq_len`


def model_facts(
    model: str | Path, seq_len: int, overrides: Mapping[str, Any] | None = None
) -> ModelFacts:
    """Load `model` (a configs/model name or a YAML path; `overrides` replace fields) with its
    own family's config class and count it; a bad config raises ConfigError (one line naming
    the field)."""
    spec, cfg = load_model_config(model, overrides)
    return ModelFacts(
        registry_name=spec.name,
        label=family_label(cfg),
        config=cfg,
        params=int(spec.count_parameters(cfg)),
        flops_per_token=float(spec.flops_per_token(cfg, int(seq_len))),
    )
