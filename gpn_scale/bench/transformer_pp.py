"""Transformer++ (LLaMA-style) for the device check's side-by-side figure: a plain PyTorch one.

Pre-RMSNorm blocks, rotary position embeddings, SwiGLU MLP, no biases, causal attention
through `F.scaled_dot_product_attention` (flash attention on a GPU in bf16), the embedding
tied to the output head. `matching_config` sizes one to a GPN config's parameter count, so
the tokens/s ratio compares models of equal size. Eager PyTorch, no torch.compile, like the
GPN it is measured against; the loss is a plain cross-entropy over the full logits (the GPN's
is chunked), which costs memory at large batches, not speed.

Deliberately small: the baseline family with its own parallelize/counts belongs in models/.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class TransformerPPConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ffn: int  # SwiGLU hidden width
    max_seq_len: int = 2048
    rope_base: float = 10000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def num_parameters(self) -> int:
        d = self.d_model
        per_layer = 4 * d * d + 3 * d * self.d_ffn + 2 * d  # attention, MLP, two norms
        return self.vocab_size * d + self.n_layers * per_layer + d

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (3 x forward, multiply-add = 2), GPN's convention: every
        matmul, the tied head included; attention over the causal half (T/2 keys on average)."""
        d, L = self.d_model, self.n_layers
        macs = L * (4 * d * d + 3 * d * self.d_ffn) + L * seq_len * d + d * self.vocab_size
        return 3.0 * 2.0 * macs


def matching_config(
    vocab_size: int, d_model: int, target_params: int, max_seq_len: int
) -> TransformerPPConfig:
    """The Transformer++ with `target_params` parameters at width `d_model` (the GPN's
    embedding width, so embedding and head are the same size): the depth whose SwiGLU width,
    solved for the parameter count, is closest to LLaMA's 8/3 d."""
    d = d_model
    head_dim = 64 if d % 64 == 0 else d
    step = 64 if d >= 256 else 8
    best = None
    for layers in range(1, 97):
        per_layer = (target_params - vocab_size * d - d) / layers
        ffn = round((per_layer - 4 * d * d - 2 * d) / (3 * d) / step) * step
        if ffn < step:
            break
        cfg = TransformerPPConfig(vocab_size, d, layers, d // head_dim, ffn, max_seq_len)
        key = (abs(ffn / d - 8 / 3), abs(cfg.num_parameters() - target_params))
        if best is None or key < best[0]:
            best = (key, cfg)
    if best is None:
        raise ValueError(
            f"no Transformer++ of width {d} has {target_params:,} parameters "
            f"(the embedding alone has {vocab_size * d:,})"
        )
    return best[1]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on (B, H, T, hd) in the rotate-half layout."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: TransformerPPConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # keep bf16 under autocast (flash path)
        y = F.scaled_dot_product_attention(
            _rotate(q, cos, sin), _rotate(k, cos, sin), v, is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: TransformerPPConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ffn)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TransformerPP(nn.Module):
    """`forward(tokens)` -> mean next-token cross-entropy over B x (T - 1) positions."""

    cos: Tensor  # rotary tables (max_seq_len, head_dim), buffers
    sin: Tensor

    def __init__(self, cfg: TransformerPPConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        inv_freq = cfg.rope_base ** -(torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.max_seq_len).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style: N(0, 0.02), residual outputs scaled by 1/sqrt(2 L)."""
        for name, p in self.named_parameters():
            if p.ndim == 1:
                nn.init.ones_(p)
            else:
                std = (
                    0.02 / math.sqrt(2 * self.config.n_layers)
                    if name.endswith(("out.weight", "down.weight"))
                    else 0.02
                )
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: Tensor) -> Tensor:
        T = tokens.shape[1]
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} > max_seq_len {self.config.max_seq_len}")
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = F.linear(self.norm(x[:, :-1]), self.embedding.weight)
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
