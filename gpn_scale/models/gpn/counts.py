"""Parameter, FLOP and memory counts from a config alone (they feed MFU and scaling fits).

FLOPs count multiply-adds as 2 and include every matmul of the model (embedding-side
fuse projection, the loop's projections, the memory's reads and writes, decode and the
tied output head). Training FLOPs per token = 3 x forward (backward = 2 x forward); the
engine's recomputation is an implementation cost and is deliberately not counted, as
for activation checkpointing in MFU conventions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpn_scale.models.gpn.config import GPNConfig


def count_parameters(cfg: GPNConfig) -> int:
    """Every parameter, the embedding included (it is also the tied output head)."""
    V, d, e, f = cfg.vocab_size, cfg.d_state, cfg.d_emb, cfg.d_ffn
    total = V * e  # embedding
    total += e + e * d  # fuse norm + projection
    total += d + d * d + d  # fuse gate
    total += d + d * e + (e if cfg.decoder_bias else 0)  # decode
    if cfg.memory:
        H, dk, dv = cfg.n_heads, cfg.d_key, cfg.d_value
        total += d + d * H * dk + H * dk + d * H * dv + 2 * d * H + 2 * H  # write
    per_layer = (d + 2 * d * f + f * d) + (d + d * d + d)  # FFN + predict gate
    if cfg.memory:
        per_layer += d + d * H * dk + H * dk + d * H * dv + H * dv + H * dv * d  # read
    return total + cfg.n_layers * per_layer


def non_embedding_parameters(cfg: GPNConfig) -> int:
    return count_parameters(cfg) - cfg.vocab_size * cfg.d_emb


def forward_flops_per_token(cfg: GPNConfig) -> float:
    V, d, e, f = cfg.vocab_size, cfg.d_state, cfg.d_emb, cfg.d_ffn
    macs = e * d  # fuse projection
    macs += d * d  # fuse gate
    macs += d * e + e * V  # decode + tied head
    if cfg.memory:
        H, dk, dv = cfg.n_heads, cfg.d_key, cfg.d_value
        macs += d * (H * dk + H * dv + 2 * H)  # write projections
        macs += 2 * H * dk * dv  # write: M^T k and the rank-1 update
    for _ in range(cfg.n_layers):
        macs += d * 2 * f + f * d + d * d  # FFN + predict gate
        if cfg.memory:
            macs += d * (H * dk + H * dv) + H * dv * d  # read projections
            macs += H * dk * dv  # M^T q
    return 2.0 * macs


def flops_per_token(cfg: GPNConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward).

    `seq_len` is accepted for interface symmetry with attention baselines, whose cost
    grows with it; GPN's per-token cost does not depend on it.
    """
    return 3.0 * forward_flops_per_token(cfg)


@dataclass(frozen=True)
class MemoryEstimate:
    parameters_bytes: int  # weights
    training_state_bytes: int  # gradients + AdamW moments
    activations_bytes: int  # what the engine keeps for backward + its working set
    total_bytes: int


def estimate_training_memory(
    cfg: GPNConfig, batch_size: int, seq_len: int, param_bytes: int = 4
) -> MemoryEstimate:
    """A planning estimate of single-device training memory for one (B, T) window."""
    n = count_parameters(cfg)
    params = n * param_bytes
    training_state = n * (param_bytes + 8)  # grad + fp32 AdamW exp_avg, exp_avg_sq
    B, T, d, e = batch_size, seq_len, cfg.d_state, cfg.d_emb
    f4 = 4
    # Saved across the loop: fused inputs, outputs p, normed p, decode h and its grad, emb.
    per_token = (3 * d + 3 * e) * f4
    chunks = math.ceil(T / cfg.engine.chunk_size)
    snapshots = chunks * B * cfg.cells * f4
    # One chunk recomputed with autograd: the step's projections plus the chunk's k/u terms.
    width = sum(_in_width(cfg, i) for i in range(cfg.n_layers))
    width += cfg.n_layers * (cfg.n_heads * cfg.d_value + cfg.d_ffn) + 4 * d
    chunk_work = 3 * B * cfg.engine.chunk_size * width * f4 + 2 * B * cfg.cells * f4
    rows = min(cfg.engine.loss_chunk_tokens, B * T)
    loss_work = 2 * rows * cfg.vocab_size * f4
    activations = B * T * per_token + snapshots + chunk_work + loss_work
    return MemoryEstimate(
        params, training_state, activations, params + training_state + activations
    )


def _in_width(cfg: GPNConfig, layer: int) -> int:
    H, dk, dv = cfg.n_heads, cfg.d_key, cfg.d_value
    width = 2 * cfg.d_ffn + cfg.d_state
    if cfg.memory:
        width += H * dk + H * dv + (H * dk + H * dv + 2 * H if layer == 0 else 0)
    return width
