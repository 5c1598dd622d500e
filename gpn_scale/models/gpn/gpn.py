"""GPN and GPN+M: parameters, reference initialisation and the training/eval forward.

The equations are those of `shared/spec/gpn-model.md`. This module holds the parameters in
ordinary submodules (nn.Linear stores (out, in)); the sequence computation itself lives in
`engine.py` (fast, chunked) and `reference.py` (step by step, tests only).

The model knows nothing about parallelism. Its forward reads the parameters of its
submodules directly (it never calls their forward), so a sharding wrapper must treat the
whole model as one unit (FSDP2: `fully_shard` on the root).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
from torch import Tensor, nn

from gpn_scale.models.gpn.config import GPNConfig
from gpn_scale.models.gpn.state import GPNOutput, GPNState

__all__ = [
    "GPN",
    "GPNOutput",
    "GPNState",
]  # the carry types live in state.py (engine.py uses them too)


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
    both halves alike (`gpn_scale.parallel.tp`); a flat (2f, d) shard would give one rank
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


class GPN(nn.Module):
    """GPN+M (memory=True) or GPN. `forward(tokens)` returns the mean next-token CE."""

    def __init__(self, cfg: GPNConfig) -> None:
        super().__init__()
        self.config = cfg
        d, e = cfg.d_state, cfg.d_emb
        self.embedding = nn.Embedding(cfg.vocab_size, e)
        self.fuse_norm_weight = nn.Parameter(torch.ones(e))
        self.fuse = nn.Linear(e, d, bias=False)
        self.fuse_gate = Gate(d)
        self.decode_norm_weight = nn.Parameter(torch.ones(d))
        self.decode = nn.Linear(d, e, bias=cfg.decoder_bias)
        self.write = MemoryWrite(d, cfg.n_heads, cfg.d_key, cfg.d_value) if cfg.memory else None
        self.layers = nn.ModuleList(PredictorLayer(cfg) for _ in range(cfg.n_layers))
        self.reset_parameters()

    @property
    def predictor_layers(self) -> Iterable[PredictorLayer]:
        """`layers` (the same nn.ModuleList, no copy) typed as what it holds: the type checker
        sees a ModuleList yield plain Modules, whose submodules are `Tensor | Module`."""
        return cast("Iterable[PredictorLayer]", self.layers)

    def reset_parameters(self) -> None:
        """The reference initialisation (spec table), in a fixed module order."""
        nn.init.normal_(self.embedding.weight, mean=0.0, std=0.02)
        nn.init.ones_(self.fuse_norm_weight)
        lecun_normal_(self.fuse.weight)
        self.fuse_gate.reset_parameters()
        nn.init.ones_(self.decode_norm_weight)
        lecun_normal_(self.decode.weight)
        if self.decode.bias is not None:
            nn.init.zeros_(self.decode.bias)
        if self.write is not None:
            self.write.reset_parameters()
        for layer in self.predictor_layers:
            layer.ffn.reset_parameters()
            layer.gate.reset_parameters()
            if layer.read is not None:
                layer.read.reset_parameters()

    # ------------------------------------------------------------------ state
    def state_dtype(self) -> torch.dtype:
        """The carry is float32 (float64 when the model is float64), never bf16/fp16."""
        dtype = self.fuse.weight.dtype
        return dtype if dtype in (torch.float32, torch.float64) else torch.float32

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> GPNState:
        cfg = self.config
        device = device if device is not None else self.fuse.weight.device
        dtype = self.state_dtype()
        zeros = torch.zeros(batch_size, cfg.d_state, device=device, dtype=dtype)
        memory = (
            torch.zeros(batch_size, cfg.n_heads, cfg.d_key, cfg.d_value, device=device, dtype=dtype)
            if cfg.memory
            else None
        )
        return GPNState(zeros, zeros.clone(), memory)

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        tokens: Tensor,
        state: GPNState | None = None,
        *,
        return_state: bool = False,
        return_logits: bool = False,
    ) -> GPNOutput:
        """Mean CE over all B*T positions; x_t is predicted from the state before it.

        `state` seeds the carry (stateful windows); `return_state` returns the final carry
        (differentiable; detach it before the next window unless you backprop across).
        Under torch.autocast the large matmuls run in the autocast dtype, the state and
        memory stay in float32.
        """
        from gpn_scale.models.gpn.engine import run_engine

        return run_engine(
            self, tokens, state, return_state=return_state, return_logits=return_logits
        )

    def next_token_logits(self, state: GPNState) -> Tensor:
        """(B, V) logits of the token after the context carried by `state`.

        Position 0's logits of a one-token forward are computed from the carry before that
        token is seen, so any token serves; one step, the context is never recomputed.
        """
        B = state.s.shape[0]
        probe = torch.zeros(B, 1, dtype=torch.long, device=state.s.device)
        logits = self.forward(probe, state, return_logits=True).logits
        assert logits is not None
        return logits[:, 0]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
