"""GPN's building blocks: the gates, the SwiGLU FFN, the memory write and read, and a
predictor layer. gpn.py assembles them into the model; the sequence engine (engine.py) and
the reference path (reference.py) read their parameters. Parameters only: no module here
runs a forward of its own (the engine folds their weights into its fused matmuls).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from gpn_scale.models.gpn.config import GPNConfig


def lecun_normal_(weight: Tensor) -> Tensor:
    """Truncated normal (at +-2 sd) rescaled to std 1/sqrt(fan_in), as the reference's init.

    nn.Linear weights are (out, in), so fan_in is the second dimension.
    """
    std = 1.0 / math.sqrt(weight.shape[1])
    # 0.8796... is the std of a standard normal truncated to [-2, 2].
    scaled = std / 0.87962566103423978
    return nn.init.trunc_normal_(weight, mean=0.0, std=scaled, a=-2 * scaled, b=2 * scaled)


class Gate(nn.Module):
    """sigmoid(rms(x; w) @ W + b)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(d))
        self.proj = nn.Linear(d, d, bias=True)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.norm_weight)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)


class HalvesLinear(nn.Module):
    """The bias-free W_1 of a SwiGLU in block layout: `weight` is (2, f, d), the [a | b]
    halves as a leading axis (row block 0 gives a, block 1 gives b; `flat()` is the usual
    (2f, d) nn.Linear weight, a view). Stored so, tensor parallelism shards the f axis of
    both halves alike (`models/gpn/parallelize.py`); a flat (2f, d) shard would give one rank
    all of `a`. Same values as nn.Linear(d, 2f) under the same seed (same numel and order);
    a (2f, d) tensor from an older checkpoint loads into it."""

    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        flat = torch.empty(2 * f, d)
        # nn.Linear's construction-time init, kept so that the RNG stream (hence every model
        # built from a seed) is the one of the (2f, d) nn.Linear this replaced.
        nn.init.kaiming_uniform_(flat, a=math.sqrt(5))
        self.weight = nn.Parameter(flat.view(2, f, d))

    def flat(self) -> Tensor:
        return self.weight.flatten(0, 1)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "weight"
        value = state_dict.get(key)
        if isinstance(value, Tensor) and value.dim() == 2:
            state_dict[key] = value.reshape(self.weight.shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class SwiGLU(nn.Module):
    """(silu(a) * b) @ W_2 with [a | b] = rms(x; w) @ W_1."""

    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(d))
        self.w1 = HalvesLinear(d, f)
        self.w2 = nn.Linear(f, d, bias=False)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.norm_weight)
        lecun_normal_(self.w1.flat())
        nn.init.zeros_(self.w2.weight)


class MemoryWrite(nn.Module):
    """Key from s_prev, value/strength/decay from s, all through one shared RMSNorm."""

    def __init__(self, d: int, H: int, dk: int, dv: int) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(d))
        self.key = nn.Linear(d, H * dk, bias=True)
        self.value = nn.Linear(d, H * dv, bias=False)
        self.beta = nn.Linear(d, H, bias=False)
        self.decay = nn.Linear(d, H, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.norm_weight)
        for lin in (self.key, self.value, self.beta, self.decay):
            lecun_normal_(lin.weight)
        nn.init.zeros_(self.key.bias)
        with torch.no_grad():
            A = torch.empty_like(self.A_log).uniform_(0.0, 16.0)
            self.A_log.copy_(torch.log(A.clamp_min(1e-8)))
            u = torch.rand_like(self.dt_bias)
            dt = torch.exp(u * (math.log(0.1) - math.log(0.001)) + math.log(0.001)).clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


class MemoryRead(nn.Module):
    """(silu(hq @ W_rg) * rms(M^T q; w_out)) @ W_o with q = l2n(relu(hq @ W_q + b_q))."""

    def __init__(self, d: int, H: int, dk: int, dv: int) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(d))
        self.query = nn.Linear(d, H * dk, bias=True)
        self.gate = nn.Linear(d, H * dv, bias=False)
        self.out_norm_weight = nn.Parameter(torch.ones(H * dv))
        self.out = nn.Linear(H * dv, d, bias=False)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.norm_weight)
        lecun_normal_(self.query.weight)
        nn.init.zeros_(self.query.bias)
        lecun_normal_(self.gate.weight)
        nn.init.ones_(self.out_norm_weight)
        nn.init.normal_(self.out.weight, mean=0.0, std=0.02)


class PredictorLayer(nn.Module):
    """c <- Gate_p(c) * c + FFN(c) + read(c, M)."""

    def __init__(self, cfg: GPNConfig) -> None:
        super().__init__()
        self.ffn = SwiGLU(cfg.d_state, cfg.d_ffn)
        self.gate = Gate(cfg.d_state)
        self.read = (
            MemoryRead(cfg.d_state, cfg.n_heads, cfg.d_key, cfg.d_value) if cfg.memory else None
        )
