"""The gated delta-rule matrix memory, in recurrent and chunkwise form.

Per head, M is dk x dv. Per step t with decay a_t = exp(g_t), write strength b_t, key k_t,
value v_t and query q_t:

    rule "gpn":  u_t = b_t (v_t -       M_{t-1}^T k_t)     (GPN+M: error against the UNdecayed M)
    rule "gdn":  u_t = b_t (v_t - a_t * M_{t-1}^T k_t)     (Gated DeltaNet)
    M_t = a_t M_{t-1} + k_t u_t^T,    o_t = M_t^T q_t      (the read sees this step's write)

`memory_recurrent` is the obviously-correct step-by-step form (the memory materialised every
step); `memory_chunkwise` is the parallel form of `shared/spec/memory-chunkwise.md`: a unit
lower-triangular solve and a few GEMMs per chunk, with every decay exponent a difference
G_t - G_j <= 0, so nothing overflows and nothing divides by a (which reaches 1e-17).
Both are plain differentiable torch code: their backward passes are autograd's.

Shapes: q, k (B, H, T, dk); v (B, H, T, dv); log_a, b (B, H, T); M0 (B, H, dk, dv).
Returns (o (B, H, T, dv), M_T (B, H, dk, dv)).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Rule = Literal["gpn", "gdn"]


def _check_rule(rule: str) -> None:
    if rule not in ("gpn", "gdn"):
        raise ValueError(f"rule: expected 'gpn' or 'gdn', got {rule!r}")


def memory_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_a: Tensor,
    b: Tensor,
    M0: Tensor | None = None,
    rule: Rule = "gpn",
) -> tuple[Tensor, Tensor]:
    """Step-by-step reference: materialises M after every step."""
    _check_rule(rule)
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    M = M0 if M0 is not None else k.new_zeros(B, H, dk, dv)
    outs = []
    for t in range(T):
        a = log_a[:, :, t].exp()[..., None, None]
        prior = M if rule == "gpn" else a * M
        pred = torch.einsum("bhkv,bhk->bhv", prior, k[:, :, t])
        u = b[:, :, t, None] * (v[:, :, t] - pred)
        M = a * M + torch.einsum("bhk,bhv->bhkv", k[:, :, t], u)
        outs.append(torch.einsum("bhkv,bhk->bhv", M, q[:, :, t]))
    return torch.stack(outs, dim=2), M


def memory_chunkwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_a: Tensor,
    b: Tensor,
    M0: Tensor | None = None,
    rule: Rule = "gpn",
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunkwise-parallel form: T/C sequential chunk steps, everything inside a chunk in GEMMs.

    Works for any T (the last chunk may be shorter) and any chunk_size >= 1.
    """
    _check_rule(rule)
    if chunk_size < 1:
        raise ValueError(f"chunk_size: must be >= 1, got {chunk_size}")
    B, H, T, dk = k.shape
    dv = v.shape[-1]
    M = M0 if M0 is not None else k.new_zeros(B, H, dk, dv)
    outs = []
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        o, M = _chunk(
            q[:, :, start:end],
            k[:, :, start:end],
            v[:, :, start:end],
            log_a[:, :, start:end],
            b[:, :, start:end],
            M,
            rule,
        )
        outs.append(o)
    return torch.cat(outs, dim=2), M


def _chunk(
    q: Tensor, k: Tensor, v: Tensor, log_a: Tensor, b: Tensor, M0: Tensor, rule: str
) -> tuple[Tensor, Tensor]:
    U, G = chunk_errors(k, v, log_a, b, M0, rule)
    return chunk_read(q, k, U, G, M0), chunk_advance(k, U, G, M0)


def chunk_errors(
    k: Tensor,
    v: Tensor,
    log_a: Tensor,
    b: Tensor,
    M0: Tensor,
    rule: str = "gpn",
    kM0: Tensor | None = None,
    kk: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The chunk's write terms u_t (B, H, C, dv) and cumulative log decays G_t (B, H, C).

    U = (I + A)^{-1} diag(b) (V - diag(e^{G_err}) K M0), A strictly lower triangular.
    `kM0`, `kk`: k @ M0 and k @ k^T when the caller has them already (the engine's
    recompute keeps the first and needs the second for its predictions too).
    """
    C = k.shape[2]
    G = torch.cumsum(log_a, dim=-1)
    # The error term sees the memory decayed up to t-1 (gpn) or up to t (gdn).
    G_err = G - log_a if rule == "gpn" else G
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=k.device), diagonal=-1)
    # exp of G_err_t - G_j on the strict lower triangle (<= 0 there); zero elsewhere.
    decay_err = masked_exp(G_err[..., :, None] - G[..., None, :], strict)
    if kk is None:
        kk = k @ k.transpose(-1, -2)
    A = b[..., :, None] * kk * decay_err
    if kM0 is None:
        kM0 = k @ M0
    rhs = b[..., None] * (v - G_err.exp()[..., None] * kM0)
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    return U, G


def chunk_read(
    q: Tensor,
    k: Tensor,
    U: Tensor,
    G: Tensor,
    M0: Tensor,
    qM0: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """o_t = M_t^T q_t for every step of the chunk (the read sees step t's write). `qM0`:
    q @ M0 when the caller has it already (the engine's recompute keeps it for the sweep);
    `out`: a (B, H, C, dv) tensor (any strides a batched GEMM writes) to write o into."""
    C = k.shape[2]
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=k.device))
    decay_out = masked_exp(G[..., :, None] - G[..., None, :], incl)
    if qM0 is None:
        qM0 = q @ M0
    within = (q @ k.transpose(-1, -2)) * decay_out
    if out is None:
        return G.exp()[..., None] * qM0 + within @ U
    # the same sum, its product written by the GEMM, the decayed M0 read added in place
    batched_mm(within, U, out)
    return out.addcmul_(G.exp()[..., None], qM0)


def batched_mm(a: Tensor, b: Tensor, out: Tensor) -> Tensor:
    """out = a @ b for (..., m, k) @ (..., k, n), the leading dims folded into one batch of
    a GEMM that writes `out` where it lies (a strided view: no product copied there after)."""
    fold = lambda t: t.flatten(0, -3) if t.dim() > 3 else t  # noqa: E731
    torch.bmm(fold(a), fold(b), out=fold(out))
    return out


def chunk_advance(k: Tensor, U: Tensor, G: Tensor, M0: Tensor) -> Tensor:
    """M at the end of the chunk: e^{G_C} M0 + (K o e^{G_C - G})^T U."""
    G_end = G[..., -1:]
    return G_end.exp()[..., None] * M0 + (k * (G_end - G).exp()[..., None]).transpose(-1, -2) @ U


def masked_exp(x: Tensor, mask: Tensor) -> Tensor:
    """exp(x) where `mask`, 0 elsewhere (a chunk's decays between two steps). Masked before
    exp: above the diagonal the differences are positive and could overflow."""
    return torch.where(mask, x, float("-inf")).exp()
