"""Transformer++ (LLaMA-style decoder) behind the language-model interface.

Our own ~200 lines rather than transformers' LlamaForCausalLM (installed), because:
- the interface's alignment (protocol.py) scores position 0 from a learned start token held
  as the pending input of the state; Llama's forward shifts labels inside its loss and
  scores T-1 positions, so it would need a wrapper that re-does embedding, shift and loss;
- the state is our own (per-layer K/V cache + pending token + length) and must detach,
  shard under FSDP2 per block and be read one step at a time by `next_token_logits`;
  HF's Cache classes carry generation concerns (beam reorder, sliding windows) we do not use;
- the tensor-parallel plan and the FLOP count name our module paths (layers.i.attn.q ...),
  which stay stable across transformers releases.
The pieces are the well-kept ones: torch.nn.RMSNorm, F.scaled_dot_product_attention (flash /
memory-efficient kernels on GPU), the shared SwiGLU (models/blocks.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpn_scale.models.blocks import SwiGLU, shift_in, start_tokens
from gpn_scale.models.linear_cross_entropy import linear_cross_entropy
from gpn_scale.models.protocol import LMOutput
from gpn_scale.models.transformer_pp.config import TransformerPPConfig


@dataclass
class TransformerPPState:
    """What one call hands the next: per-layer keys/values (B, H, P, hd; keys after RoPE),
    the pending input token (B,) and the context length P the cache holds."""

    keys: list[Tensor]
    values: list[Tensor]
    pending: Tensor
    length: int

    def detach(self) -> TransformerPPState:
        return TransformerPPState(
            [k.detach() for k in self.keys],
            [v.detach() for v in self.values],
            self.pending.detach(),
            self.length,
        )


def rope_tables(
    positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (T, head_dim) for the given absolute positions (LLaMA's half-split
    layout: dimension i pairs with i + head_dim/2)."""
    inv = 1.0 / (
        theta
        ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.to(torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Multi-head causal self-attention with RoPE. Head count is read from the projection's
    local width, so a column-sharded q/k/v (tensor parallel) runs its own heads unchanged."""

    def __init__(self, cfg: TransformerPPConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        q, k, v = (
            proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
            P = k.shape[2] - T
            # Query i (absolute P + i) sees keys 0..P+i; SDPA's is_causal aligns top-left.
            mask = None
            if T > 1:
                qi = torch.arange(T, device=x.device)[:, None] + P
                mask = torch.arange(P + T, device=x.device)[None, :] <= qi
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(B, T, -1)
        return self.o(out), k, v


class Block(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)): the unit FSDP2 shards and TP splits."""

    def __init__(self, cfg: TransformerPPConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ffn)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        h, k, v = self.attn(self.attn_norm(x), cos, sin, cache)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), k, v


class TransformerPP(nn.Module):
    def __init__(self, cfg: TransformerPPConfig) -> None:
        super().__init__()
        self.config = cfg
        # V + 1 rows: id V is the start token (models/blocks.py); the head scores V tokens.
        self.embed = nn.Embedding(cfg.vocab_size + 1, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = (
            None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        )
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                out = name.endswith(("attn.o", "mlp.down"))
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if out else std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def initial_state(
        self, batch_size: int, device: torch.device | str | None = None
    ) -> TransformerPPState:
        device = device if device is not None else self.embed.weight.device
        return TransformerPPState(
            [], [], start_tokens(batch_size, self.config.vocab_size, device), 0
        )

    def _head_weight(self) -> Tensor:
        """The output matrix (V, d): the head's, or the tied embedding's first V rows."""
        if self.head is None:
            return self.embed.weight[: self.config.vocab_size]
        return self.head.weight

    def _logits(self, h: Tensor) -> Tensor:
        return F.linear(self.norm(h), self._head_weight())

    def _run(
        self, inputs: Tensor, state: TransformerPPState | None
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Hidden states of `inputs` (B, T) after the cache `state` holds, and the new caches."""
        P = 0 if state is None else state.length
        x = self.embed(inputs)
        positions = torch.arange(P, P + inputs.shape[1], device=inputs.device)
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            cache = None if state is None or P == 0 else (state.keys[i], state.values[i])
            x, k, v = layer(x, cos, sin, cache)
            keys.append(k)
            values.append(v)
        return x, keys, values

    def forward(
        self,
        tokens: Tensor,
        state: TransformerPPState | None = None,
        *,
        return_state: bool = False,
        return_logits: bool = False,
    ) -> LMOutput:
        """logits[:, t] predicts tokens[:, t] given tokens[:, :t] and the cached context."""
        pending = (
            start_tokens(tokens.shape[0], self.config.vocab_size, tokens.device)
            if state is None
            else state.pending
        )
        inputs, next_pending = shift_in(tokens, pending)
        h, keys, values = self._run(inputs, state)
        h = self.norm(h)
        # A block of positions at a time: the (B*T x V) logits exist only when asked for.
        loss = linear_cross_entropy(h, self._head_weight(), tokens, self.config.loss_chunk_tokens)
        logits = F.linear(h, self._head_weight()) if return_logits else None
        new_state = None
        if return_state:
            P = 0 if state is None else state.length
            new_state = TransformerPPState(keys, values, next_pending, P + tokens.shape[1])
        return LMOutput(loss, new_state, logits)

    def next_token_logits(self, state: TransformerPPState) -> Tensor:
        """(B, V): one step of the pending token against the cache (nothing recomputed)."""
        h, _, _ = self._run(state.pending[:, None], state)
        return self._logits(h)[:, -1]
