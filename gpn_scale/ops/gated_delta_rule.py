"""The gated delta rule of Gated DeltaNet behind one call, with the kernel chosen at run time.

Per head, with the state S (dk x dv), per step t: q_t and k_t L2-normalised (x / sqrt(|x|^2 +
1e-6), fla's l2norm), decay a_t = exp(g_t) (g_t <= 0), write strength beta_t in (0, 1):

    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,     o_t = scale * S_t^T q_t

(the error is taken against the DECAYED state: rule "gdn" of ops/memory.py; GPN+M's rule
differs). Backends, all computing the same function:

  chunk      our chunkwise op (ops/memory.py, rule "gdn"): plain torch, any device, autograd
  recurrent  our step-by-step op (ops/memory.py): the spec; slow, for tests and FLOP counts
  fla        flash-linear-attention's Triton kernels (chunk_gated_delta_rule for training,
             fused_recurrent_gated_delta_rule for short no-grad calls, as fla's layer does);
             CUDA tensors only
  auto       fla on CUDA tensors when fla imports (else chunk, with one warning); chunk on
             any other device

The config's choice can be overridden by the environment variable GPN_SCALE_GDN_BACKEND.
Layout is fla's: q, k (B, T, H, dk); v (B, T, H, dv); g, beta (B, T, H); state (B, H, dk, dv)
(float32, or float64 for float64 inputs). The state layout is the same for every backend, so
a state carried by one is read by another.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from gpn_scale.ops.backends import ANY_DEVICE, OpBackend, OpRegistry, import_error
from gpn_scale.ops.memory import memory_chunkwise, memory_recurrent

ENV_VAR = "GPN_SCALE_GDN_BACKEND"
L2_EPS = 1e-6  # fla's l2norm epsilon (inside the square root)


class GatedDeltaRuleError(RuntimeError):
    """A backend was asked for that cannot serve these tensors (one line: what and the fix)."""


class GatedDeltaRule(Protocol):
    name: str

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        *,
        scale: float,
        initial_state: Tensor | None,
        chunk_size: int,
    ) -> tuple[Tensor, Tensor]:
        """(o (B, T, H, dv) in v's dtype, final state (B, H, dk, dv))."""
        ...


def l2_normalise(x: Tensor, eps: float = L2_EPS) -> Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _state_dtype(*tensors: Tensor) -> torch.dtype:
    # The recurrence and its state run in float32 at least (bf16 states drift over long spans).
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class _TorchRule:
    """Ours (ops/memory.py), in (B, H, T, d) layout inside."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        *,
        scale: float,
        initial_state: Tensor | None,
        chunk_size: int,
    ) -> tuple[Tensor, Tensor]:
        dtype = _state_dtype(q, k, v, g, beta)
        qh, kh, vh = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
        qh = l2_normalise(qh) * scale
        kh = l2_normalise(kh)
        gh, bh = g.to(dtype).transpose(1, 2), beta.to(dtype).transpose(1, 2)
        M0 = None if initial_state is None else initial_state.to(dtype)
        if self.name == "recurrent":
            o, state = memory_recurrent(qh, kh, vh, gh, bh, M0, rule="gdn")
        else:
            o, state = memory_chunkwise(qh, kh, vh, gh, bh, M0, rule="gdn", chunk_size=chunk_size)
        return o.transpose(1, 2).to(v.dtype), state


class _FlaRule:
    """flash-linear-attention's kernels (l2norm fused in, state in fla's default K x V layout)."""

    name = "fla"

    def __init__(self) -> None:
        from fla.ops.gated_delta_rule import (
            chunk_gated_delta_rule,
            fused_recurrent_gated_delta_rule,
        )

        self._chunk = chunk_gated_delta_rule
        self._recurrent = fused_recurrent_gated_delta_rule

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        *,
        scale: float,
        initial_state: Tensor | None,
        chunk_size: int,
    ) -> tuple[Tensor, Tensor]:
        h0 = None if initial_state is None else initial_state.float()
        # As fla's layer passes them: beta in the activations' dtype, log decays in float32.
        beta = beta.to(v.dtype)
        # fla's layer decodes with the fused recurrent kernel (short, no backward needed).
        kernel = self._recurrent if (q.shape[1] <= 64 and not torch.is_grad_enabled()) else None
        if kernel is not None:
            o, state = kernel(
                q=q,
                k=k,
                v=v,
                g=g.float(),
                beta=beta,
                scale=scale,
                initial_state=h0,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
        else:
            o, state = self._chunk(
                q,
                k,
                v,
                g.float(),
                beta,
                scale=scale,
                initial_state=h0,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
        return o.to(v.dtype), state


def requested(config_choice: str = "auto") -> str:
    """The backend asked for: the environment override if set, else the config's choice."""
    return BACKENDS.requested(config_choice)


def fla_import_error() -> str | None:
    """Why fla's kernels cannot be imported here, or None when they can (Triton itself may
    fail at import on odd platforms, hence any exception)."""
    return import_error("fla.ops.gated_delta_rule", (Exception,))


def _fla_missing() -> str | None:
    why = fla_import_error()
    if why is None:
        return None
    return f"flash-linear-attention does not import ({why}); install the 'fla' extra"


BACKENDS = OpRegistry("gated delta rule", ENV_VAR, "backend", GatedDeltaRuleError)
BACKENDS.register(
    OpBackend(
        "chunk",
        (ANY_DEVICE,),
        10,
        description="our chunkwise op (torch)",
        build=lambda request: _TorchRule("chunk"),
    )
)
BACKENDS.register(
    OpBackend(
        "recurrent",
        (ANY_DEVICE,),
        0,
        description="our step-by-step op: the spec",
        build=lambda request: _TorchRule("recurrent"),
    )
)
BACKENDS.register(
    OpBackend(
        "fla",
        ("cuda",),
        20,
        _fla_missing,
        description="fla's Triton kernels",
        build=lambda request: _FlaRule(),
        wrong_device_hint="run on a CUDA machine with the 'fla' extra",
    )
)


def select(config_choice: str, device: torch.device) -> GatedDeltaRule:
    """The backend for tensors on `device` (the registry's rule; see the module docstring)."""
    return BACKENDS.select(config_choice, device.type)


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    backend: str = "auto",
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """(o, final state) of the gated delta rule over T steps (see the module docstring).

    `scale` defaults to dk^-0.5 (fla's).
    """
    rule = select(backend, q.device)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return rule(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size)
