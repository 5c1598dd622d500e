"""Gated DeltaNet's parameter and FLOP counts from a config alone (they feed MFU and fits).

FLOPs count a multiply-add as 2, over every matmul-like op of the forward: the projections,
the short depthwise convolutions (K taps per channel), the MLP, the head, and the gated delta
rule by its recurrent form: per head and token S^T k, the rank-1 write k u^T and the read
S^T q, i.e. 3 dk dv multiply-adds. That is the algorithm's cost, independent of how a kernel
computes it (our chunkwise op and fla's chunk kernel spend more on intra-chunk terms; this
matches the convention of GPN's counts in models/gpn/counts.py, so families compare on one scale).
Norms, gates, activations and the embedding lookup are not counted. Training FLOPs per token
= 3 x forward (backward = 2 x forward); the cost does not depend on the sequence length.
"""

from __future__ import annotations

from gpn_scale.models.gated_deltanet.config import GatedDeltaNetConfig


def layer_parameters(cfg: GatedDeltaNetConfig) -> int:
    """One block: two RMSNorms, the token mixer and the SwiGLU MLP."""
    d, H, dk, dv, f, K = (
        cfg.d_model,
        cfg.n_heads,
        cfg.d_key,
        cfg.d_value,
        cfg.d_ffn,
        cfg.conv_size,
    )
    mixer = 2 * d * H * dk + d * H * dv  # q, k, v projections
    mixer += 2 * d * H + 2 * H  # a, b projections; A_log, dt_bias
    mixer += K * (2 * H * dk + H * dv)  # short convolutions
    mixer += d * H * dv + dv + H * dv * d  # output gate, gated norm weight, o_proj
    return 2 * d + mixer + 3 * d * f


def count_parameters(cfg: GatedDeltaNetConfig) -> int:
    """Every parameter: embedding (V + 1 rows: the start token), blocks, final norm, head."""
    V, d = cfg.vocab_size, cfg.d_model
    return (V + 1) * d + cfg.n_layers * layer_parameters(cfg) + d + V * d


def non_embedding_parameters(cfg: GatedDeltaNetConfig) -> int:
    return count_parameters(cfg) - (cfg.vocab_size + 1) * cfg.d_model


def recurrence_macs_per_token(cfg: GatedDeltaNetConfig) -> int:
    """The gated delta rule's multiply-adds per token, one layer (see the module docstring)."""
    return 3 * cfg.n_heads * cfg.d_key * cfg.d_value


def forward_flops_per_token(cfg: GatedDeltaNetConfig) -> float:
    d, H, dk, dv, f, K = (
        cfg.d_model,
        cfg.n_heads,
        cfg.d_key,
        cfg.d_value,
        cfg.d_ffn,
        cfg.conv_size,
    )
    per_layer = d * (2 * H * dk + 2 * H * dv + 2 * H) + H * dv * d  # projections
    per_layer += K * (2 * H * dk + H * dv)  # depthwise convolutions
    per_layer += recurrence_macs_per_token(cfg)
    per_layer += 3 * d * f  # MLP
    return 2.0 * (cfg.n_layers * per_layer + d * cfg.vocab_size)


def flops_per_token(cfg: GatedDeltaNetConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward); `seq_len` is accepted for
    the FamilySpec's signature (attention's cost grows with it; this one does not)."""
    return 3.0 * forward_flops_per_token(cfg)
