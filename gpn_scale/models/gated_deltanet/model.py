"""Gated DeltaNet (Yang et al., "Gated Delta Networks") as the GPN paper's baseline uses it.

The anchor is flash-linear-attention's GatedDeltaNet layer and GatedDeltaNetForCausalLM (its
parametrisation and initialisation), written here as our own module because the interface
needs what fla's HF model does not give: the alignment of protocol.py (position 0 scored from
a learned start token held as the pending input), a state we carry, detach and read one step
at a time, module paths our FSDP units and FLOP counts name, and a CPU path (fla's kernels are
Triton-only; ours is the chunkwise op in ops/memory.py) held equal to fla's reference forms.

Per layer (token mixer), from x (B, T, d):
    q, k, v  = SiLU(causal depthwise conv_4(W_q x)), ... (W_k x), ... (W_v x)
    beta     = sigmoid(W_b x)                                   (B, T, H)
    g        = -exp(A_log) * softplus(W_a x + dt_bias)          log decay, <= 0
    o        = gated delta rule(l2norm(q), l2norm(k), v, g, beta)   (ops/gated_delta_rule.py)
    y        = W_o [RMSNorm_dv(o) * w * SiLU(W_g x)]            fla's FusedRMSNormGated
Blocks: x += mixer(RMSNorm(x)); x += SwiGLU(RMSNorm(x)); then a final RMSNorm and the head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from gpn_scale.models.blocks import SwiGLU, shift_in, start_tokens
from gpn_scale.models.gated_deltanet.config import GatedDeltaNetConfig
from gpn_scale.models.linear_cross_entropy import linear_cross_entropy
from gpn_scale.models.protocol import LMOutput
from gpn_scale.ops.gated_delta_rule import gated_delta_rule


def _local(p: Tensor) -> Tensor:
    """This rank's share of a parameter sharded by tensor parallelism (parallelize.py; its
    gradient returns as a DTensor of the same placement), the tensor itself otherwise."""
    return p.to_local() if isinstance(p, DTensor) else p


def _at_least_f32(x: Tensor) -> Tensor:
    """Gates, norms and the recurrence run in float32 under bf16 (float64 stays float64)."""
    return x if x.dtype == torch.float64 else x.float()


class LayerState:
    """One layer's carry: the memory (B, H, dk, dv) and the last conv_size - 1 inputs of each
    short convolution (B, channels, conv_size - 1), oldest first.

    A plain class on purpose, not a NamedTuple or dataclass: FSDP2's mixed precision casts
    every floating tensor it finds in a unit's forward arguments (it walks tuples, dicts,
    NamedTuples and dataclasses) to param_dtype, which would round the float32 memory to
    bf16 at every block; an object it does not walk reaches the layer as it was made.
    """

    __slots__ = ("memory", "conv_q", "conv_k", "conv_v")

    def __init__(self, memory: Tensor, conv_q: Tensor, conv_k: Tensor, conv_v: Tensor) -> None:
        self.memory, self.conv_q, self.conv_k, self.conv_v = memory, conv_q, conv_k, conv_v

    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.memory, self.conv_q, self.conv_k, self.conv_v

    def detach(self) -> LayerState:
        return LayerState(*(t.detach() for t in self.tensors()))


@dataclass(frozen=True)
class GatedDeltaNetState:
    """Per-layer carries and the pending input token (B,) not yet consumed."""

    layers: tuple[LayerState, ...]
    pending: Tensor

    def detach(self) -> GatedDeltaNetState:
        return GatedDeltaNetState(tuple(s.detach() for s in self.layers), self.pending.detach())


class ShortConv(nn.Module):
    """Causal depthwise conv1d over time, then SiLU (fla's ShortConvolution, no bias).

    The cache holds the previous kernel_size - 1 inputs, so a window continues the last one
    exactly (zeros before the first token, as a left zero-padding).
    """

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    def forward(self, x: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        full = torch.cat([cache.to(x.dtype), x.transpose(1, 2)], dim=-1)  # (B, C, K-1+T)
        y = F.conv1d(full, _local(self.weight).to(x.dtype), groups=full.shape[1])
        keep = self.kernel_size - 1
        return F.silu(y).transpose(1, 2), full[..., full.shape[-1] - keep :]


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's dv values, times SiLU(gate) (fla's FusedRMSNormGated, swish),
    computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        xf = _at_least_f32(x)
        w: Tensor = self.weight
        if isinstance(w, DTensor):  # tp: shared by every head, each rank holds some heads
            from gpn_scale.ops.gpn_step.collectives import sum_grad_over_tp

            mesh = w.device_mesh  # tp is its innermost (or only) dimension
            w = sum_grad_over_tp(w.to_local(), mesh.get_group(mesh.ndim - 1))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * w.to(xf.dtype)
        return (y * F.silu(gate.to(xf.dtype))).to(x.dtype)


class GatedDeltaNetLayer(nn.Module):
    """The token mixer (see the module docstring)."""

    def __init__(self, cfg: GatedDeltaNetConfig) -> None:
        super().__init__()
        d, H, dk, dv = cfg.d_model, cfg.n_heads, cfg.d_key, cfg.d_value
        self.cfg = cfg
        self.q_proj = nn.Linear(d, H * dk, bias=False)
        self.k_proj = nn.Linear(d, H * dk, bias=False)
        self.v_proj = nn.Linear(d, H * dv, bias=False)
        self.a_proj = nn.Linear(d, H, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.q_conv = ShortConv(H * dk, cfg.conv_size)
        self.k_conv = ShortConv(H * dk, cfg.conv_size)
        self.v_conv = ShortConv(H * dv, cfg.conv_size)
        self.g_proj = nn.Linear(d, H * dv, bias=False)
        self.o_norm = GatedRMSNorm(dv, cfg.norm_eps)
        self.o_proj = nn.Linear(H * dv, d, bias=False)
        self.tp_size = 1  # ranks the heads are split over (parallelize.apply_tp)

    @torch.no_grad()
    def reset_decay(self) -> None:
        """fla's init: A ~ U(0, 16), A_log = log A; dt log-uniform in [1e-3, 0.1] (floor 1e-4),
        dt_bias = softplus^{-1}(dt), so the initial decays exp(-A * dt) span fast to slow."""
        H = self.A_log.numel()
        self.A_log.copy_(torch.empty(H).uniform_(0, 16).log())
        dt_min, dt_max = 1e-3, 0.1
        dt = torch.exp(torch.rand(H) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def local_heads(self) -> int:
        """The heads this rank computes: all of them, or H / tp under tensor parallelism
        (`tp_size` is set by parallelize.apply_tp; read from it, not from a parameter's
        shape, which FSDP2 shards too outside the block's forward)."""
        return self.cfg.n_heads // self.tp_size

    def initial_state(self, batch_size: int, device: torch.device) -> LayerState:
        cfg = self.cfg
        H, dk, dv, keep = self.local_heads(), cfg.d_key, cfg.d_value, cfg.conv_size - 1
        dtype = torch.float64 if self.q_proj.weight.dtype == torch.float64 else torch.float32

        def zeros(*shape: int) -> Tensor:
            return torch.zeros(*shape, device=device, dtype=dtype)

        return LayerState(
            zeros(batch_size, H, dk, dv),
            zeros(batch_size, H * dk, keep),
            zeros(batch_size, H * dk, keep),
            zeros(batch_size, H * dv, keep),
        )

    def forward(self, x: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        cfg = self.cfg
        B, T, _ = x.shape
        H, dk, dv = self.local_heads(), cfg.d_key, cfg.d_value
        q, conv_q = self.q_conv(self.q_proj(x), state.conv_q)
        k, conv_k = self.k_conv(self.k_proj(x), state.conv_k)
        v, conv_v = self.v_conv(self.v_proj(x), state.conv_v)
        beta = torch.sigmoid(_at_least_f32(self.b_proj(x)))
        a = _at_least_f32(self.a_proj(x))
        A_log, dt_bias = _local(self.A_log), _local(self.dt_bias)
        g = -A_log.to(a.dtype).exp() * F.softplus(a + dt_bias.to(a.dtype))
        o, memory = gated_delta_rule(
            q.view(B, T, H, dk),
            k.view(B, T, H, dk),
            v.view(B, T, H, dv),
            g,
            beta,
            initial_state=state.memory,
            backend=cfg.backend,
            chunk_size=cfg.chunk_size,
        )
        o = self.o_norm(o, self.g_proj(x).view(B, T, H, dv))
        return self.o_proj(o.reshape(B, T, H * dv)), LayerState(memory, conv_q, conv_k, conv_v)


class GatedDeltaNetBlock(nn.Module):
    """Pre-RMSNorm token mixer, then pre-RMSNorm SwiGLU MLP, each on the residual stream."""

    def __init__(self, cfg: GatedDeltaNetConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = GatedDeltaNetLayer(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ffn)

    def forward(self, x: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        mixed, state = self.attn(self.attn_norm(x), state)
        x = x + mixed
        return x + self.mlp(self.mlp_norm(x)), state


class GatedDeltaNet(nn.Module):
    """The language model (protocol.LanguageModel). The embedding has V + 1 rows (the start
    token is id V); the head (untied, fla's default) has V."""

    def __init__(self, cfg: GatedDeltaNetConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size + 1, cfg.d_model)
        self.layers = nn.ModuleList(GatedDeltaNetBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """fla's GatedDeltaNetForCausalLM init (see GatedDeltaNetConfig.init_std)."""
        cfg = self.config
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding, ShortConv)):
                nn.init.normal_(module.weight, mean=0.0, std=cfg.init_std)
            elif isinstance(module, (nn.RMSNorm, GatedRMSNorm)):
                nn.init.ones_(module.weight)
            if isinstance(module, GatedDeltaNetLayer):
                module.reset_decay()
        if cfg.rescale_prenorm_residual:
            # GPT-2's scheme: the two residual writers per block scaled by 1/sqrt(2L).
            for block in self.layers:
                assert isinstance(block, GatedDeltaNetBlock)
                block.attn.o_proj.weight.div_(math.sqrt(2 * cfg.n_layers))
                block.mlp.down.weight.div_(math.sqrt(2 * cfg.n_layers))

    def initial_state(
        self, batch_size: int, device: torch.device | str | None = None
    ) -> GatedDeltaNetState:
        dev = torch.device(device) if device is not None else self.embed.weight.device
        layers = tuple(
            block.attn.initial_state(batch_size, dev)  # type: ignore[union-attr, operator]
            for block in self.layers
        )
        return GatedDeltaNetState(layers, start_tokens(batch_size, self.config.vocab_size, dev))

    def _trunk(
        self, inputs: Tensor, states: tuple[LayerState, ...]
    ) -> tuple[Tensor, tuple[LayerState, ...]]:
        x = self.embed(inputs)
        new_states = []
        for block, state in zip(self.layers, states, strict=True):
            x, state = block(x, state)
            new_states.append(state)
        return self.norm(x), tuple(new_states)

    def forward(
        self,
        tokens: Tensor,
        state: GatedDeltaNetState | None = None,
        *,
        return_state: bool = False,
        return_logits: bool = False,
    ) -> LMOutput:
        """Mean CE over all B*T positions; logits[:, t] predicts tokens[:, t] (protocol.py)."""
        if state is None:
            state = self.initial_state(tokens.shape[0], tokens.device)
        inputs, pending = shift_in(tokens, state.pending)
        h, layers = self._trunk(inputs, state.layers)
        # A block of positions at a time: the (B*T x V) logits exist only when asked for.
        loss = linear_cross_entropy(h, self.head.weight, tokens, self.config.loss_chunk_tokens)
        return LMOutput(
            loss,
            # pending is a view of `tokens`: cloned so a caller's in-place edit of its batch
            # cannot change the carry (FSDP2 also warns about views among a unit's outputs).
            GatedDeltaNetState(layers, pending.clone()) if return_state else None,
            self.head(h) if return_logits else None,
        )

    def next_token_logits(self, state: GatedDeltaNetState) -> Tensor:
        """(B, V): the pending token through every layer's carried memory and conv cache, one
        step; the context is never recomputed."""
        h, _ = self._trunk(state.pending[:, None], state.layers)
        return self.head(h[:, 0])

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
