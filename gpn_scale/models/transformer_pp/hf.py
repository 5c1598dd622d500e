"""Transformer++ <-> Hugging Face Llama (`LlamaForCausalLM`): the same network, other names.

Our block is Llama's (pre-RMSNorm, RoPE in the half-split layout, SwiGLU, no biases, as many
key/value heads as query heads), so only the names and the start token need mapping:
- our embedding has V + 1 rows, row V being the learned start token every window begins
  with (models/blocks.py); in the Llama checkpoint it is token id V, the `bos_token_id`;
- our head scores V ids; Llama's has V + 1 rows (one per embedding row): the start token's
  row is zero when the head is untied (the embedding row itself when tied). That id is
  never a prediction: the exported generation config suppresses it (and any padded id).
So Llama's logits[..., :V] on `[V] + tokens[:-1]` equal ours on `tokens`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gpn_scale.models.transformer_pp.config import TransformerPPConfig

_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.o.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}


def start_token_id(cfg: TransformerPPConfig) -> int:
    return int(cfg.vocab_size)


def llama_config(cfg: TransformerPPConfig, *, eos_token_id: int, max_positions: int) -> Any:
    """The `transformers.LlamaConfig` of this model (vocabulary V + 1: the start token)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=cfg.vocab_size + 1,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ffn,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=max_positions,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=start_token_id(cfg),
        eos_token_id=eos_token_id,
    )


def to_llama(sd: dict[str, Tensor], cfg: TransformerPPConfig) -> dict[str, Tensor]:
    """Our state dict -> LlamaForCausalLM's (lm_head included, also when tied)."""
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    for i in range(cfg.n_layers):
        for ours, theirs in _LAYER.items():
            out[f"model.layers.{i}.{theirs}"] = sd[f"layers.{i}.{ours}"]
    if cfg.tie_embeddings:
        out["lm_head.weight"] = sd["embed.weight"]
    else:
        head = sd["head.weight"]
        out["lm_head.weight"] = torch.cat([head, head.new_zeros(1, head.shape[1])])
    return out


def from_llama(sd: dict[str, Tensor], cfg: TransformerPPConfig) -> dict[str, Tensor]:
    """LlamaForCausalLM's state dict (as `to_llama` wrote it) -> ours."""
    out = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    for i in range(cfg.n_layers):
        for ours, theirs in _LAYER.items():
            out[f"layers.{i}.{ours}"] = sd[f"model.layers.{i}.{theirs}"]
    if not cfg.tie_embeddings:
        out["head.weight"] = sd["lm_head.weight"][: cfg.vocab_size]
    return out
