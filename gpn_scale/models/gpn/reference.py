"""The slow, obviously-correct path: the spec's equations one token at a time.

The memory is materialised after every step and autograd records everything. Tests hold
the engine equal to this; the engine benchmark measures against it. Not for training.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from gpn_scale.models.gpn.config import GPNConfig
from gpn_scale.models.gpn.gpn import GPN, GPNOutput, GPNState
from gpn_scale.models.gpn.modules import Gate, MemoryRead, MemoryWrite, SwiGLU
from gpn_scale.ops.gpn_step.chunk import make_spans


def _at_least_fp32(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * w, computed in at least float32, then cast back."""
    xf = _at_least_fp32(x)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


def l2_normalize(x: Tensor) -> Tensor:
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-12)


def _gate(gate: Gate, x: Tensor, eps: float) -> Tensor:
    return torch.sigmoid(
        F.linear(rms_norm(x, gate.norm_weight, eps), gate.proj.weight, gate.proj.bias)
    )


def _ffn(ffn: SwiGLU, x: Tensor, eps: float) -> Tensor:
    a, b = F.linear(rms_norm(x, ffn.norm_weight, eps), ffn.w1.flat()).chunk(2, dim=-1)
    return F.linear(F.silu(a) * b, ffn.w2.weight)


def _read(read: MemoryRead, c: Tensor, M: Tensor, eps: float) -> Tensor:
    B, H, dk, dv = M.shape
    hq = rms_norm(c, read.norm_weight, eps)
    q = l2_normalize(F.relu(F.linear(hq, read.query.weight, read.query.bias)).view(B, H, dk))
    m = torch.einsum("bhkv,bhk->bhv", M, q).reshape(B, H * dv)
    return F.linear(
        F.silu(F.linear(hq, read.gate.weight)) * rms_norm(m, read.out_norm_weight, eps),
        read.out.weight,
    )


def _chunk_starts(cfg: GPNConfig, T: int, tbptt: int) -> frozenset[int]:
    """The steps where the engine's chunks start, if its steps read M0 rounded to bf16."""
    if not cfg.engine.bf16_memory_reads:
        return frozenset()
    spans, _ = make_spans(T, cfg.engine.chunk_size, tbptt)
    return frozenset(start for start, _ in spans)


def _write(
    w: MemoryWrite, cfg: GPNConfig, s: Tensor, s_prev: Tensor, M: Tensor, read: Tensor
) -> tuple[Tensor, Tensor]:
    """One step's memory write: (the memory after it, its decay). `read`: the memory as the
    error term reads it (M, or M with the chunk's rounding under bf16 memory reads)."""
    eps = cfg.norm_eps
    B, H, dk, dv = s.shape[0], cfg.n_heads, cfg.d_key, cfg.d_value
    hk, hv = rms_norm(s_prev, w.norm_weight, eps), rms_norm(s, w.norm_weight, eps)
    k = l2_normalize(F.relu(F.linear(hk, w.key.weight, w.key.bias)).view(B, H, dk))
    v = F.linear(hv, w.value.weight).view(B, H, dv)
    beta = torch.sigmoid(F.linear(hv, w.beta.weight))
    alpha = torch.exp(
        -torch.exp(_at_least_fp32(w.A_log))
        * F.softplus(_at_least_fp32(F.linear(hv, w.decay.weight)) + w.dt_bias)
    )
    alpha = alpha.to(M.dtype)
    err = v - torch.einsum("bhkv,bhk->bhv", read, k)
    M = alpha[..., None, None] * M + beta[..., None, None] * torch.einsum("bhk,bhv->bhkv", k, err)
    return M, alpha


class StepRecord(NamedTuple):
    """What one step exposes to an observer (`reference_forward(on_step=...)`)."""

    t: int  # position in the window
    p: Tensor  # (B, d) predicted state: the one decoded into the logits of x_t
    grounded: Tensor  # (B, d) g = s after x_t is fused in
    alpha: Tensor | None  # (B, H) memory decay applied at this step's write (None for GPN)


def reference_forward(
    model: GPN,
    tokens: Tensor,
    state: GPNState | None = None,
    *,
    tbptt: int | None = None,
    return_state: bool = False,
    return_logits: bool = False,
    on_step: Callable[[StepRecord], None] | None = None,
) -> GPNOutput:
    """Step-by-step GPN / GPN+M. `tbptt` defaults to the model config's.

    `on_step` sees every step's states (the state analyses, gpn_scale/eval/analysis, stream
    them from here: this path already materialises them, the training engine never does).

    Under `engine.bf16_memory_reads` the steps read the memory as the engine's chunks do:
    the memory M_t = e^{G_t} M0 + (the chunk's writes) is read with M0 rounded to bf16, i.e.
    M_t + e^{G_t} (bf16(M0) - M0), the rounding's difference held out of the gradient; the
    memory carried on stays M_t. The chunks start where the engine's do (`make_spans`).
    """
    cfg = model.config
    eps = cfg.norm_eps
    tbptt = cfg.tbptt if tbptt is None else tbptt
    B, T = tokens.shape
    if state is None:
        state = model.initial_state(B, tokens.device)
    s, s_prev, M = state
    E = model.embedding.weight
    total = s.new_zeros(())
    all_logits = []
    alpha = None
    rounded = _chunk_starts(cfg, T, tbptt) if M is not None else frozenset()
    rounding = None  # e^{G_t} (bf16(M0) - M0) of the current chunk, under bf16 memory reads
    for t in range(T):
        if tbptt and t > 0 and t % tbptt == 0:
            s, s_prev = s.detach(), s_prev.detach()
            M = None if M is None else M.detach()
        # 1. memory write (once per token, before any read)
        read = None  # the memory as this step's reads see it, after the write
        if model.write is not None:
            assert M is not None  # GPN+M: the state carries the memory
            if t in rounded:  # a chunk starts: M is its M0
                rounding = M.detach().to(torch.bfloat16).to(M.dtype) - M.detach()
            before = M if rounding is None else M + rounding  # what the error term reads
            M, alpha = _write(model.write, cfg, s, s_prev, M, before)
            if rounding is not None:
                rounding = alpha[..., None, None] * rounding
            read = M if rounding is None else M + rounding
        # 2. predict
        c = s
        for layer in model.predictor_layers:
            update = _ffn(layer.ffn, c, eps)
            if layer.read is not None:
                assert read is not None
                update = update + _read(layer.read, c, read, eps)
            c = _gate(layer.gate, c, eps) * c + update
        p = c
        # 3. decode; the state that has not seen x_t predicts x_t
        logits = F.linear(
            F.linear(
                rms_norm(p, model.decode_norm_weight, eps), model.decode.weight, model.decode.bias
            ),
            E,
        )
        total = total + F.cross_entropy(_at_least_fp32(logits), tokens[:, t], reduction="sum")
        if return_logits:
            all_logits.append(logits)
        # 4. ground
        grounding = F.linear(
            rms_norm(E[tokens[:, t]], model.fuse_norm_weight, eps), model.fuse.weight
        )
        g = _gate(model.fuse_gate, p, eps) * p + grounding
        if on_step is not None:
            on_step(StepRecord(t, p, g, alpha))
        s, s_prev = g, s
    return GPNOutput(
        loss=total / (B * T),
        state=GPNState(s, s_prev, M) if return_state else None,
        logits=torch.stack(all_logits, dim=1) if return_logits else None,
    )
