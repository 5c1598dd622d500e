"""Transformer++ parameter and FLOP counts from a config alone (MFU, sweeps, fits).

FLOPs count a multiply-add as 2. Forward per token: every matmul (q, k, v, o, the SwiGLU's
gate/up/down, the V x d head; the embedding is a lookup) plus attention's scores and
weighted sum, 2 x 2 x T x d per layer at the full window length T (the PaLM / Chinchilla
convention, and what torch's FlopCounterMode counts for SDPA: causality's halving is not
credited). Training = 3 x forward (backward = 2 x forward).
"""

from __future__ import annotations

from gpn_scale.models.transformer_pp.config import TransformerPPConfig


def count_parameters(cfg: TransformerPPConfig) -> int:
    """Every parameter: embedding (V + 1 rows: the start token), blocks, final norm, head."""
    V, d, f, L = cfg.vocab_size, cfg.d_model, cfg.d_ffn, cfg.n_layers
    per_layer = 4 * d * d + 3 * d * f + 2 * d  # q k v o, gate up down, two RMSNorms
    head = 0 if cfg.tie_embeddings else V * d
    return (V + 1) * d + L * per_layer + d + head


def non_embedding_parameters(cfg: TransformerPPConfig) -> int:
    """Without the input embedding (the head counts when untied, as in Kaplan et al.)."""
    return count_parameters(cfg) - (cfg.vocab_size + 1) * cfg.d_model


def forward_flops_per_token(cfg: TransformerPPConfig, seq_len: int) -> float:
    V, d, f, L = cfg.vocab_size, cfg.d_model, cfg.d_ffn, cfg.n_layers
    matmul = L * (4 * d * d + 3 * d * f) + V * d
    attention = L * 2 * seq_len * d  # QK^T and AV: 2 x T x d multiply-adds per layer
    return 2.0 * (matmul + attention)


def flops_per_token(cfg: TransformerPPConfig, seq_len: int) -> float:
    """Training FLOPs per token at window length `seq_len` (forward + backward)."""
    return 3.0 * forward_flops_per_token(cfg, seq_len)


def matching_config(vocab_size: int, d_model: int, target_params: int) -> TransformerPPConfig:
    """The Transformer++ of width `d_model` (tied embedding and head) with about
    `target_params` parameters: the depth whose SwiGLU width, solved for the parameter count,
    is closest to LLaMA's 8/3 d (the device check's side-by-side model for a GPN of that
    size and embedding width)."""
    d = d_model
    head_dim = 64 if d % 64 == 0 else d
    step = 64 if d >= 256 else 8
    best = None
    for layers in range(1, 97):
        # Everything but the SwiGLU (as count_parameters counts it, tied: no separate head).
        fixed = (vocab_size + 1) * d + d + layers * (4 * d * d + 2 * d)
        ffn = round((target_params - fixed) / (layers * 3 * d) / step) * step
        if ffn < step:
            break
        cfg = TransformerPPConfig(vocab_size, d, layers, d // head_dim, ffn, tie_embeddings=True)
        key = (abs(ffn / d - 8 / 3), abs(count_parameters(cfg) - target_params))
        if best is None or key < best[0]:
            best = (key, cfg)
    if best is None:
        raise ValueError(
            f"no Transformer++ of width {d} has {target_params:,} parameters "
            f"(the embedding alone has {vocab_size * d:,})"
        )
    return best[1]
