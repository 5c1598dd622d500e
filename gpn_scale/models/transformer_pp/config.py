"""Transformer++ hyper-parameters: one validated, frozen dataclass (the GPNConfig habits).

Symbols: V=vocab_size, d=d_model, L=n_layers, H=n_heads (head width d/H), f=d_ffn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from gpn_scale.core.config import ConfigError, check_fields


@dataclass(frozen=True)
class TransformerPPConfig:
    """A LLaMA-style decoder: pre-RMSNorm, RoPE, SwiGLU, no biases.

    `tie_embeddings: false` (the default) is what the fla / LLaMA 130M baselines the paper
    compares against use (fla's TransformerConfig: tie_word_embeddings=False): a separate
    V x d output head, ~134M parameters at the paper's 12 x 768 shape (~110M tied).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ffn: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # Weights ~ N(0, init_std); the residual outputs (o, down) are scaled by 1/sqrt(2L)
    # (fla's rescale_prenorm_residual, GPT-2's scheme).
    init_std: float = 0.02
    # The head's cross-entropy runs over this many positions at a time, its gradients formed
    # in the same pass (models/linear_cross_entropy.py), never the B*T x V logits at once;
    # how the loss is computed, never what (GPN's engine.loss_chunk_tokens).
    loss_chunk_tokens: int = 1024
    name: str = ""
    family_name: ClassVar[str] = "transformer_pp"

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ffn", "loss_chunk_tokens"):
            _require_int(key, getattr(self, key))
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.n_heads: {self.n_heads} does not divide d_model={self.d_model}; "
                "choose n_heads so that d_model / n_heads is an integer"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"model.n_heads: head width d_model/n_heads = {self.head_dim} is odd; RoPE "
                "rotates pairs of dimensions, choose n_heads so that it is even"
            )
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(
                f"model.tie_embeddings: expected true or false, got {self.tie_embeddings!r}"
            )
        for key in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"model.{key}: expected a positive number, got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def family(self) -> str:
        """The label fits and reports use (GPNConfig.family is "gpn+m"/"gpn")."""
        return self.family_name

    def to_dict(self) -> dict[str, Any]:
        # `family` first: a checkpoint's saved config names the family that resumes it.
        return {"family": self.family_name, **dataclasses.asdict(self)}

    def replace(self, **changes: Any) -> TransformerPPConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TransformerPPConfig:
        """Build from a mapping; an unknown key fails naming the closest valid one."""
        values = {k: v for k, v in values.items() if not (k == "family" and v == cls.family_name)}
        check_fields(cls, values, f"unknown key for family {cls.family_name}")
        return cls(**dict(values))


def _require_int(key: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"model.{key}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"model.{key}: must be >= {minimum}, got {value}")
