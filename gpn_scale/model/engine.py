"""The sequence engine: GPN / GPN+M over a window, fast and exact.

Layout of one forward (see `shared/spec/gpn-model.md` for the equations):

1. Outside the time loop, over all B*T positions at once: embedding and fuse projection.
2. The time loop (`_SequenceFunction`), chunk by chunk:
   - every projection of one input is ONE matmul: the grounded state s feeds the memory
     write (k for the next step, v, beta, decay) and layer 0's read query, read gate,
     FFN and predict gate; RMSNorm weights are folded into those matrices
     (rms(x; w) @ W == (x / rms(x)) @ (diag(w) W)); the read output and FFN share one
     down-projection matmul;
   - the memory stays in chunk form (`ops/memory.py`, use 2): a read-only chunk-start M0,
     plus the chunk's keys, errors u_j and cumulative log-decays; M advances once per chunk;
   - backward is chunk by chunk in reverse: the forward keeps the outputs p_t and the
     states s_t entering each step (O(T*d)) and one carry (s, s_prev, M) per chunk. Per
     chunk the backward first recomputes every activation in parallel (C*B-row matmuls and
     the fully parallel chunk memory form: no step loop), then runs a hand-written reverse
     sweep whose only per-step matmuls are the inherent input gradients dy @ W^T; weight
     gradients (and dM0) are one large matmul per chunk, never a rank-B update per step.
     The sweep is held equal to autograd through the reference path by the tests.
3. Outside the loop again: decode and cross-entropy in chunks of positions
   (`model/loss.py`), never the full B x T x V logits.

Under torch.autocast the large matmuls run in the autocast dtype; the state, the memory
and every elementwise recurrence op stay in float32.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from gpn_scale.model.config import GPNConfig
from gpn_scale.model.gpn import GPN, GPNOutput, GPNState
from gpn_scale.model.loss import chunked_decode_cross_entropy
from gpn_scale.ops.memory import chunk_advance, chunk_errors, chunk_read
from gpn_scale.ops.step_kernels import kernels_for

# ------------------------------------------------------------------ phase timing
_PHASES: dict[str, float] | None = None   # set by `phase_timer()` (benchmarks only)


@contextlib.contextmanager
def phase_timer() -> Iterator[dict[str, float]]:
    """Accumulate wall time per engine phase while active (for `gpn_scale.bench.engine`)."""
    global _PHASES
    previous, _PHASES = _PHASES, {}
    try:
        yield _PHASES
    finally:
        _PHASES = previous


@contextlib.contextmanager
def _phase(name: str) -> Iterator[None]:
    if _PHASES is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        _PHASES[name] = _PHASES.get(name, 0.0) + time.perf_counter() - start


# ----------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class _Plan:
    """Static description of one engine call (everything that is not a tensor)."""

    n_layers: int
    memory: bool
    H: int
    dk: int
    dv: int
    d: int
    f: int
    eps: float
    spans: tuple[tuple[int, int], ...]     # chunk boundaries [start, end)
    cuts: frozenset[int]                    # positions where truncated BPTT stops gradients
    mm_dtype: torch.dtype | None            # matmul dtype under autocast, else None
    in_splits: tuple[tuple[int, ...], ...]  # column blocks of each layer's input matmul


def input_column_blocks(cfg: GPNConfig, layer: int) -> tuple[int, ...]:
    """Column blocks of layer `layer`'s fused input matmul, in order."""
    H, dk, dv = cfg.n_heads, cfg.d_key, cfg.d_value
    sizes: list[int] = []
    if cfg.memory and layer == 0:
        sizes += [H * dk, H * dv, H, H]          # write: key (next step), value, beta, decay
    if cfg.memory:
        sizes += [H * dk, H * dv]                # read: query, gate
    return (*sizes, 2 * cfg.d_ffn, cfg.d_state)  # FFN in, predict gate


def make_spans(T: int, chunk_size: int, tbptt: int) -> tuple[tuple[tuple[int, int], ...],
                                                           frozenset[int]]:
    """Chunk boundaries every `chunk_size` steps, and also at every truncation point."""
    cuts = frozenset(range(tbptt, T, tbptt)) if tbptt else frozenset()
    bounds = sorted(set(range(0, T, chunk_size)) | cuts | {T})
    return tuple(zip(bounds[:-1], bounds[1:])), cuts


# --------------------------------------------------------------------- weights
@dataclass
class _LoopWeights:
    """The loop's matrices in (in, out) layout with norm weights folded in."""

    w_in: list[Tensor]
    b_in: list[Tensor]
    w_out: list[Tensor]
    w_fg: Tensor
    b_fg: Tensor
    A: Tensor | None            # exp(A_log): the decay rate per head

    def flat(self) -> list[Tensor]:
        return [*self.w_in, *self.b_in, *self.w_out, self.w_fg, self.b_fg,
                *([self.A] if self.A is not None else [])]

    @staticmethod
    def unflat(plan: _Plan, flat: list[Tensor] | tuple[Tensor, ...]) -> _LoopWeights:
        L = plan.n_layers
        return _LoopWeights(list(flat[:L]), list(flat[L:2 * L]), list(flat[2 * L:3 * L]),
                            flat[3 * L], flat[3 * L + 1], flat[3 * L + 2] if plan.memory else None)

    def transposed(self) -> _LoopWeights:
        """The matrices transposed and contiguous (for the backward's dy @ W^T); the key
        columns of layer 0 come first in its transpose's rows."""
        return _LoopWeights([w.t().contiguous() for w in self.w_in], self.b_in,
                            [w.t().contiguous() for w in self.w_out],
                            self.w_fg.t().contiguous(), self.b_fg, self.A)

    def untransposed_views(self) -> _LoopWeights:
        """Views of transposed copies back in (in, out) layout (no copy)."""
        return _LoopWeights([w.t() for w in self.w_in], self.b_in, [w.t() for w in self.w_out],
                            self.w_fg.t(), self.b_fg, self.A)

    def for_matmul(self, dtype: torch.dtype | None) -> _LoopWeights:
        """Matrices cast once to the matmul dtype (biases and A stay in the state dtype)."""
        if dtype is None:
            return self
        return _LoopWeights([w.to(dtype) for w in self.w_in], self.b_in,
                            [w.to(dtype) for w in self.w_out], self.w_fg.to(dtype), self.b_fg,
                            self.A)


def fold_loop_weights(model: GPN) -> _LoopWeights:
    """Build the loop's fused matrices from the module's parameters (differentiable)."""
    cfg = model.config
    w_in, b_in, w_out = [], [], []
    for i, layer in enumerate(model.layers):
        cols: list[Tensor] = []
        biases: list[Tensor] = []
        if i == 0 and model.write is not None:
            wr = model.write
            nw = wr.norm_weight[:, None]
            cols += [nw * wr.key.weight.t(), nw * wr.value.weight.t(), nw * wr.beta.weight.t(),
                     nw * wr.decay.weight.t()]
            biases += [wr.key.bias, wr.key.bias.new_zeros(cfg.n_heads * cfg.d_value),
                       wr.key.bias.new_zeros(cfg.n_heads), wr.dt_bias]
        if layer.read is not None:
            rd = layer.read
            nr = rd.norm_weight[:, None]
            cols += [nr * rd.query.weight.t(), nr * rd.gate.weight.t()]
            biases += [rd.query.bias, rd.query.bias.new_zeros(cfg.n_heads * cfg.d_value)]
        cols += [layer.ffn.norm_weight[:, None] * layer.ffn.w1.weight.t(),
                 layer.gate.norm_weight[:, None] * layer.gate.proj.weight.t()]
        biases += [layer.gate.proj.bias.new_zeros(2 * cfg.d_ffn), layer.gate.proj.bias]
        w_in.append(torch.cat(cols, dim=1))
        b_in.append(torch.cat(biases))
        outs = []
        if layer.read is not None:
            outs.append(layer.read.out_norm_weight[:, None] * layer.read.out.weight.t())
        outs.append(layer.ffn.w2.weight.t())
        w_out.append(torch.cat(outs, dim=0))
    fg = model.fuse_gate
    A = torch.exp(model.write.A_log) if model.write is not None else None
    return _LoopWeights(w_in, b_in, w_out, fg.norm_weight[:, None] * fg.proj.weight.t(),
                        fg.proj.bias, A)


# ------------------------------------------------------------------ the loop
def _rms(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _l2n(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-12)


class _ChunkHistory:
    """The chunk's k_j, u_j, G_j so far, in preallocated buffers (no copy of the history per
    step)."""

    def __init__(self, B: int, H: int, C: int, dk: int, dv: int, like: Tensor) -> None:
        self.K = like.new_empty(B, H, C, dk)
        self.U = like.new_empty(B, H, C, dv)
        self.G = like.new_empty(B, H, C)

    def append(self, tau: int, k: Tensor, u: Tensor, G: Tensor) -> None:
        self.K[:, :, tau] = k
        self.U[:, :, tau] = u
        self.G[:, :, tau] = G

    def upto(self, n: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.K[:, :, :n], self.U[:, :, :n], self.G[:, :, :n]


def _run_chunk(plan: _Plan, W: _LoopWeights, fuse: Tensor, s: Tensor, s_prev: Tensor,
               M0: Tensor | None, S_out: Tensor | None = None
               ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The steps of one chunk (no autograd). fuse: (B, C, d).

    Returns (P (B, C, d), s, s_prev, M_end); `S_out` (B, C, d), when given, receives the
    state entering every step (what the backward's parallel recompute starts from).
    """
    B, C, _ = fuse.shape
    H, dk, dv, eps = plan.H, plan.dk, plan.dv, plan.eps
    mem = plan.memory
    if mem:
        k_cols = H * dk
        k = _l2n(F.relu(_matmul(_rms(s_prev, eps), W.w_in[0][:, :k_cols], W.b_in[0][:k_cols]))
                 .view(B, H, dk))
        history = _ChunkHistory(B, H, C, dk, dv, s)
        G_prev = s.new_zeros(B, H)
    P = fuse.new_empty(B, C, fuse.shape[-1])
    for tau in range(C):
        if S_out is not None:
            S_out[:, tau] = s
        c = s
        for i in range(plan.n_layers):
            y = _matmul(_rms(c, eps), W.w_in[i], W.b_in[i])
            parts = torch.split(y, plan.in_splits[i], dim=-1)
            if mem and i == 0:
                k_next_pre, v, beta_pre, decay_pre, q_pre, rg, ffn_in, pg = parts
                v = v.view(B, H, dv)
                G = G_prev + (-W.A * F.softplus(decay_pre))
                q = _l2n(F.relu(q_pre).view(B, H, dk))
                # One read of M0 for the key (error term) and the query (read after write).
                kq = torch.stack([k, q], dim=2)
                r = kq @ M0
                err_base = G_prev.exp()[..., None] * r[:, :, 0]
                out_base = G.exp()[..., None] * r[:, :, 1]
                if tau:
                    K, U, Gj = history.upto(tau)   # (B, H, tau, dk), (.., dv), (B, H, tau)
                    expo = torch.stack([G_prev, G], dim=2)[..., None] - Gj[:, :, None, :]
                    hist = ((kq @ K.mT) * expo.exp()) @ U
                    err_base = err_base + hist[:, :, 0]
                    out_base = out_base + hist[:, :, 1]
                u = torch.sigmoid(beta_pre)[..., None] * (v - err_base)
                o = out_base + (q * k).sum(-1, keepdim=True) * u
                history.append(tau, k, u, G)
                G_prev = G
                k = _l2n(F.relu(k_next_pre).view(B, H, dk))
            elif mem:
                q_pre, rg, ffn_in, pg = parts
                q = _l2n(F.relu(q_pre).view(B, H, dk))
                K, U, Gj = history.upto(tau + 1)
                w = (q[:, :, None] @ K.mT) * (G[..., None, None] - Gj[:, :, None, :]).exp()
                o = G.exp()[..., None] * (q[:, :, None] @ M0)[:, :, 0] + (w @ U)[:, :, 0]
            else:
                ffn_in, pg = parts
            a, b = ffn_in.chunk(2, dim=-1)
            hidden = F.silu(a) * b
            if mem:
                hidden = torch.cat([F.silu(rg) * _rms(o.reshape(B, H * dv), eps), hidden], dim=-1)
            c = torch.sigmoid(pg) * c + _matmul(hidden, W.w_out[i], None)
        P[:, tau] = c
        gate = torch.sigmoid(_matmul(_rms(c, eps), W.w_fg, W.b_fg))
        s_prev, s = s, gate * c + fuse[:, tau]
    M_end = None
    if mem:
        K, U, Gj = history.upto(C)
        M_end = chunk_advance(K, U, Gj, M0)
    return P, s, s_prev, M_end


def _run_chunk_fused(plan: _Plan, W: _LoopWeights, kernels, fuse: Tensor, s: Tensor,
                     s_prev: Tensor, M0: Tensor | None, P: Tensor, S_out: Tensor | None
                     ) -> tuple[Tensor, Tensor, Tensor | None]:
    """`_run_chunk` in one call of the fused CPU kernel (`ops/step_kernels.py`); writes the
    chunk's outputs into P (B, C, d) and returns (s, s_prev, M_end)."""
    out = kernels.chunk_forward(plan.n_layers, plan.memory, plan.H, plan.dk, plan.dv, plan.f,
                                plan.eps, W.w_in, W.b_in, W.w_out, W.w_fg, W.b_fg, W.A, fuse,
                                s, s_prev, M0, P, S_out)
    if not plan.memory:
        return out[0], out[1], None
    s, s_prev, K, U, G = out
    return s, s_prev, chunk_advance(K, U, G, M0)


# --------------------------------------------------------------------- backward
@dataclass
class _ChunkActs:
    """Every activation of a chunk, recomputed in parallel. Dense ones are (C, B, width);
    memory ones (B, H, C, width)."""

    c: list[Tensor]            # input of each layer (c_0 = S)
    n: list[Tensor]            # rms(c_i)
    y: list[Tensor]            # the fused input matmul's output
    hidden: list[Tensor]       # input of the down-projection
    o: list[Tensor | None]     # memory read output (flat, H*dv)
    ro: list[Tensor | None]    # rms(o)
    q: list[Tensor | None]     # read queries (B, H, C, dk)
    rq: list[Tensor | None]    # M0^T q
    n_p: Tensor                # rms(p)
    gate: Tensor               # sigmoid of the fuse gate
    p: Tensor
    s_prev: Tensor | None = None    # (B, d): the chunk's first key comes from it
    n_sprev: Tensor | None = None   # rms(s_prev)
    k_pre: Tensor | None = None     # (C, B, H*dk), row t = the pre-activation of k_t
    k: Tensor | None = None
    v: Tensor | None = None
    beta: Tensor | None = None
    U: Tensor | None = None
    G: Tensor | None = None
    pred: Tensor | None = None      # M_{t-1}^T k_t
    rk: Tensor | None = None        # M0^T k_t


@torch.no_grad()
def _recompute_chunk(plan: _Plan, W: _LoopWeights, S: Tensor, s_prev: Tensor,
                     M0: Tensor | None) -> _ChunkActs:
    """Given the states S (B, C, d) entering each step, the whole chunk at once.

    Every projection is ONE (C*B)-row matmul and the memory is the fully parallel chunk
    form (`ops.memory`, use 1): no few-row matmul, no step loop.
    """
    B, C, d = S.shape
    H, dk, dv, eps = plan.H, plan.dk, plan.dv, plan.eps
    mem = plan.memory
    c = S.transpose(0, 1).contiguous()                          # (C, B, d)
    acts = _ChunkActs([], [], [], [], [], [], [], [], None, None, None)
    for i in range(plan.n_layers):
        n = _rms(c, eps)
        y = _matmul(n, W.w_in[i], W.b_in[i])
        acts.c.append(c)
        acts.n.append(n)
        acts.y.append(y)
        parts = torch.split(y, plan.in_splits[i], dim=-1)
        if mem and i == 0:
            k_next_pre, v, beta_pre, decay_pre, q_pre, rg, ffn_in, pg = parts
            k_cols = H * dk
            acts.s_prev = s_prev
            acts.n_sprev = _rms(s_prev, eps)
            k_first = _matmul(acts.n_sprev, W.w_in[0][:, :k_cols], W.b_in[0][:k_cols])
            acts.k_pre = torch.cat([k_first[None], k_next_pre[:-1]], dim=0)
            acts.k = _heads(_l2n(F.relu(acts.k_pre).view(C, B, H, dk)))
            acts.v = _heads(v.reshape(C, B, H, dv))
            log_a = (-W.A * F.softplus(decay_pre)).permute(1, 2, 0)          # (B, H, C)
            acts.beta = torch.sigmoid(beta_pre).permute(1, 2, 0)
            U, acts.G = chunk_errors(acts.k, acts.v, log_a, acts.beta, M0, "gpn")
            acts.U = U.contiguous()    # the solve returns it column-major; the sweep reads rows
            acts.rk = _step_major(acts.k @ M0)
            acts.pred = _step_major(_prediction(acts, M0))
        elif mem:
            q_pre, rg, ffn_in, pg = parts
        else:
            ffn_in, pg = parts
        a, b = ffn_in.chunk(2, dim=-1)
        hidden = F.silu(a) * b
        if mem:
            q = _heads(_l2n(F.relu(q_pre).view(C, B, H, dk)))
            rq = _step_major(q @ M0)
            o = chunk_read(q, acts.k, acts.U, acts.G, M0).permute(2, 0, 1, 3).reshape(C, B, H * dv)
            ro = _rms(o, eps)
            hidden = torch.cat([F.silu(rg) * ro, hidden], dim=-1)
            acts.q.append(q)
            acts.rq.append(rq)
            acts.o.append(o)
            acts.ro.append(ro)
        else:
            acts.q.append(None)
            acts.rq.append(None)
            acts.o.append(None)
            acts.ro.append(None)
        acts.hidden.append(hidden)
        c = torch.sigmoid(pg) * c + _matmul(hidden, W.w_out[i], None)
    acts.p = c
    acts.n_p = _rms(c, eps)
    acts.gate = torch.sigmoid(_matmul(acts.n_p, W.w_fg, W.b_fg))
    return acts


def _prediction(acts: _ChunkActs, M0: Tensor) -> Tensor:
    """M_{t-1}^T k_t for every step:
    e^{G_{t-1}} M0^T k_t + sum_{j<t} e^{G_{t-1}-G_j}(k_t.k_j) u_j."""
    G = acts.G
    G_prev = torch.cat([torch.zeros_like(G[..., :1]), G[..., :-1]], dim=-1)
    C = G.shape[-1]
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=G.device), diagonal=-1)
    expo = torch.where(strict, G_prev[..., :, None] - G[..., None, :], float("-inf"))
    return G_prev.exp()[..., None] * acts.rk + ((acts.k @ acts.k.mT) * expo.exp()) @ acts.U


def _step_major(x: Tensor) -> Tensor:
    """(B, H, C, n) -> the same values as a (B, H, C, n) view of a (C, B, H, n) buffer: the
    reverse sweep reads these one step at a time, and a step's rows for every head and batch
    row then lie together (prefetchable) instead of C*n apart."""
    return x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


def _heads(x: Tensor) -> Tensor:
    """(C, B, H, n) -> (B, H, C, n)."""
    return x.permute(1, 2, 0, 3)


def _mm_t(dy: Tensor, weight_t: Tensor) -> Tensor:
    """dy @ weight^T, given weight^T stored contiguous (a transposed view makes the few-row
    matmul ~2.5x slower on CPU); in the weight's (matmul) dtype, result in dy's dtype."""
    return (dy.to(weight_t.dtype) @ weight_t).to(dy.dtype)


def _rms_back(n: Tensor, x: Tensor, dn: Tensor, eps: float) -> Tensor:
    """Gradient of n = x * rsqrt(mean(x^2) + eps) at x, given dn."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return r * (dn - n * (dn * n).mean(-1, keepdim=True))


def _l2n_back(pre: Tensor, dy: Tensor) -> Tensor:
    """Gradient of y = l2n(relu(pre)) at pre, given dy."""
    x = F.relu(pre)
    rho = torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-12)
    y = x * rho
    return (pre > 0) * rho * (dy - y * (y * dy).sum(-1, keepdim=True))


def _silu_back(x: Tensor, dy: Tensor) -> Tensor:
    sig = torch.sigmoid(x)
    return dy * sig * (1 + x * (1 - sig))


@dataclass
class _Grads:
    """Weight-gradient accumulators of the whole window (float32 or float64)."""

    w_in: list[Tensor]
    b_in: list[Tensor]
    w_out: list[Tensor]
    w_fg: Tensor
    b_fg: Tensor
    A: Tensor | None

    @staticmethod
    def zeros_like(W: _LoopWeights, dtype: torch.dtype) -> _Grads:
        z = lambda t: torch.zeros(t.shape, dtype=dtype, device=t.device)  # noqa: E731
        return _Grads([z(w) for w in W.w_in], [z(b) for b in W.b_in], [z(w) for w in W.w_out],
                      z(W.w_fg), z(W.b_fg), None if W.A is None else z(W.A))

    def flat(self) -> list[Tensor]:
        return [*self.w_in, *self.b_in, *self.w_out, self.w_fg, self.b_fg,
                *([self.A] if self.A is not None else [])]


def _chunk_backward(plan: _Plan, Wt: _LoopWeights, acts: _ChunkActs, M0: Tensor | None,
                    dP: Tensor, ds_end: Tensor | None, ds_prev_end: Tensor | None,
                    dM_end: Tensor | None, grads: _Grads, d_fuse: Tensor, kernels,
                    workspace: _Workspace) -> tuple[Tensor, Tensor, Tensor | None]:
    """One chunk's backward: the hand-written reverse sweep over its steps, then the weight
    gradients.

    The per-step work is the inherent input-gradient matmuls (dy @ W^T, few rows) and cheap
    elementwise/memory terms (`_reverse_sweep`, or the fused CPU kernel doing the same when
    `kernels` is given); the activations come from `_recompute_chunk`, and every weight
    gradient (and dM0) is formed at the end as one matmul over all steps of the chunk.
    Returns the gradients of the chunk's start carry (s, s_prev, M0).
    """
    # Pushing the end memory's gradient onto the chunk's k, u and G is chunk-wide GEMM work
    # (like the recompute), timed apart from the sequential sweep that follows it.
    with _phase("memory carry backward"):
        adjoints, dM0 = _sweep_adjoints(plan, Wt, acts, M0, dP, dM_end, d_fuse, workspace)
    with _phase("sequential backward"):
        dg, dk_pre0 = _sweep(plan, Wt, acts, M0, dP, ds_end, ds_prev_end, adjoints, kernels)
    with _phase("weight gradients"):
        return _chunk_weight_gradients(plan, Wt, acts, dg, adjoints, dk_pre0, dM0, grads)


def _sweep_adjoints(plan: _Plan, Wt: _LoopWeights, acts: _ChunkActs, M0: Tensor | None,
                    dP: Tensor, dM_end: Tensor | None, d_fuse: Tensor, workspace: _Workspace
                    ) -> tuple[_SweepAdjoints, Tensor | None]:
    """The adjoint buffers the reverse sweep accumulates into, with the end-of-chunk
    memory's gradient already pushed onto k, u and G; and the (partial) dM0."""
    C, B, d = acts.p.shape
    L = plan.n_layers
    mem = plan.memory
    dt = dP.dtype
    ws = workspace
    # Written whole at every step (no zero fill needed); the memory adjoints accumulate.
    dY = [ws.take(f"dY{i}", y.shape, 0, dt) for i, y in enumerate(acts.y)]
    dZ = [ws.take(f"dZ{i}", (C, B, d), 0, dt) for i in range(L)]
    dYfg = ws.take("dYfg", (C, B, d), 0, dt)
    if mem:
        K, U, G = acts.k, acts.U, acts.G
        pushed = dM_end is not None   # the chunk's last one has no later memory
        # dK, dU, dG start as the end memory's share (written in place, no zero fill first).
        dK = ws.take("dK", K.shape, 2, dt, zero=not pushed)
        dU = ws.take("dU", U.shape, 2, dt, zero=not pushed)
        dG = ws.take("dG", G.shape, 2, dt, zero=not pushed)
        step_major = (C, *U.shape[:2], U.shape[3])     # (C, B, H, dv), see _step_major
        dRk = ws.take("dRk", step_major, 0, dt).permute(1, 2, 0, 3)
        dRq = [ws.take(f"dRq{i}", step_major, 0, dt).permute(1, 2, 0, 3) for i in range(L)]
        dA = torch.zeros_like(Wt.A)
        if pushed:                                     # M_C = e^{G_C} M0 + sum_j w_j k_j u_j^T
            G_end = G[..., -1:]
            w = (G_end - G).exp()
            KdM = K @ dM_end
            torch.mul(U @ dM_end.mT, w[..., None], out=dK)
            torch.mul(KdM, w[..., None], out=dU)
            wt = w * (KdM * U).sum(-1)
            torch.neg(wt, out=dG)
            dG[..., -1] += wt.sum(-1) + G_end[..., 0].exp() * (dM_end * M0).sum((-2, -1))
            dM0 = G_end[..., 0].exp()[..., None, None] * dM_end   # outlives the chunk
        else:
            dM0 = torch.zeros_like(M0)
    else:
        dK = dU = dG = dRk = dA = dM0 = None
        dRq = []
    return _SweepAdjoints(dY, dZ, dYfg, d_fuse, dK, dU, dG, dRk, dRq, dA), dM0


def _sweep(plan: _Plan, Wt: _LoopWeights, acts: _ChunkActs, M0: Tensor | None, dP: Tensor,
           ds_end: Tensor | None, ds_prev_end: Tensor | None, adjoints: _SweepAdjoints,
           kernels) -> tuple[Tensor, Tensor | None]:
    """The reverse sweep over the chunk's steps (fused kernel or `_reverse_sweep`), adding
    into `adjoints`. Returns the gradient of the state entering the chunk and that of the
    first key's pre-activation."""
    H, dk, dv, eps, L = plan.H, plan.dk, plan.dv, plan.eps, plan.n_layers
    mem = plan.memory
    a = adjoints
    if kernels is not None:
        mem_acts = ([acts.k_pre, acts.k, acts.v, acts.beta, acts.U, acts.G, acts.pred, acts.rk,
                     M0] if mem else [])
        return tuple(kernels.chunk_backward(
            L, mem, H, dk, dv, plan.f, eps, Wt.w_in, Wt.w_out, Wt.w_fg, Wt.A,
            acts.c, acts.n, acts.y, acts.o if mem else [], acts.ro if mem else [],
            acts.q if mem else [], acts.rq if mem else [], acts.n_p, acts.gate, acts.p,
            mem_acts, dP, ds_end, ds_prev_end, a.dY, a.dZ, a.dRq, a.dYfg, a.d_fuse,
            [a.dK, a.dU, a.dG, a.dRk, a.dA] if mem else []))
    return _reverse_sweep(plan, Wt, acts, M0, dP, ds_end, ds_prev_end, adjoints)


def _chunk_weight_gradients(plan: _Plan, Wt: _LoopWeights, acts: _ChunkActs, dg: Tensor,
                            adj: _SweepAdjoints, dk_pre0: Tensor | None, dM0: Tensor | None,
                            grads: _Grads) -> tuple[Tensor, Tensor, Tensor | None]:
    """Every weight gradient of the chunk as one matmul over its C*B rows (never a rank-B
    update per step), and the gradients of the chunk's start carry (s, s_prev, M0)."""
    C, B, _ = acts.p.shape
    L = plan.n_layers
    rows = lambda t: t.reshape(C * B, -1)           # noqa: E731
    # Accumulated in place (GEMM with beta = 1): a product the size of the weights, added
    # afterwards, would be written and read once more per chunk.
    for i in range(L):
        grads.w_in[i].addmm_(rows(acts.n[i]).t(), rows(adj.dY[i]))
        grads.b_in[i] += rows(adj.dY[i]).sum(0)
        grads.w_out[i].addmm_(rows(acts.hidden[i]).t(), rows(adj.dZ[i]))
    grads.w_fg.addmm_(rows(acts.n_p).t(), rows(adj.dYfg))
    grads.b_fg += rows(adj.dYfg).sum(0)
    if not plan.memory:
        return dg, torch.zeros_like(dg), None
    # The chunk's first key came from s_prev.
    k_cols = plan.H * plan.dk
    grads.w_in[0][:, :k_cols] += acts.n_sprev.t().to(dk_pre0.dtype) @ dk_pre0
    grads.b_in[0][:k_cols] += dk_pre0.sum(0)
    dsprev_start = _rms_back(acts.n_sprev, acts.s_prev, _mm_t(dk_pre0, Wt.w_in[0][:k_cols]),
                             plan.eps)
    grads.A += adj.dA
    dM0 = dM0 + acts.k.mT @ adj.dRk
    for i in range(L):
        dM0 = dM0 + acts.q[i].mT @ adj.dRq[i]
    return dg, dsprev_start, dM0


class _Workspace:
    """The sweep's adjoint buffers, reused from chunk to chunk. Fresh allocations of this
    size come straight from mmap, and first-touching their pages cost ~15 us per step at
    SMALL (measured): the sweep writes ~7 MB of adjoints per chunk."""

    def __init__(self, max_chunk: int, device: torch.device) -> None:
        self.max_chunk = max_chunk
        self.device = device
        self._buffers: dict[str, Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], chunk_dim: int, dtype: torch.dtype,
             zero: bool = False) -> Tensor:
        """A (possibly uninitialised) tensor of `shape`, whose dim `chunk_dim` is the chunk's
        length, viewed out of a buffer sized for the longest chunk."""
        full = list(shape)
        full[chunk_dim] = self.max_chunk
        buf = self._buffers.get(name)
        if buf is None or list(buf.shape) != full or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(full, dtype=dtype, device=self.device)
        view = buf.narrow(chunk_dim, 0, shape[chunk_dim])
        return view.zero_() if zero else view


@dataclass
class _SweepAdjoints:
    """What the reverse sweep adds to: per-step input adjoints of the chunk's matmuls (dY,
    dZ, dYfg), d_fuse, and the memory adjoints (k, u, G, the M0 reads, A)."""

    dY: list[Tensor]
    dZ: list[Tensor]
    dYfg: Tensor
    d_fuse: Tensor
    dK: Tensor | None
    dU: Tensor | None
    dG: Tensor | None
    dRk: Tensor | None
    dRq: list[Tensor]
    dA: Tensor | None


def _reverse_sweep(plan: _Plan, Wt: _LoopWeights, acts: _ChunkActs, M0: Tensor | None,
                   dP: Tensor, ds_end: Tensor | None, ds_prev_end: Tensor | None,
                   adj: _SweepAdjoints) -> tuple[Tensor, Tensor | None]:
    """The per-step reverse sweep of one chunk in PyTorch ops (the fused CPU kernel's
    reference). Returns the gradient of the state entering the chunk and that of the
    pre-activation of the chunk's first key (which came from s_prev)."""
    C, B, d = acts.p.shape
    H, dk, dv, eps, L = plan.H, plan.dk, plan.dv, plan.eps, plan.n_layers
    mem = plan.memory
    dt = dP.dtype
    dY, dZ, dYfg, d_fuse = adj.dY, adj.dZ, adj.dYfg, adj.d_fuse
    dK, dU, dG, dRk, dRq, dA = adj.dK, adj.dU, adj.dG, adj.dRk, adj.dRq, adj.dA
    ds_extra = torch.zeros(C, B, d, dtype=dt, device=dP.device)
    if ds_prev_end is not None:
        ds_extra[C - 1] += ds_prev_end                 # s_prev at the end = state entering step C-1
    dk_pre0 = None
    if mem:
        Hk, Hv = H * dk, H * dv
        K, U, G = acts.k, acts.U, acts.G
        dk_next_pre = torch.zeros(B, Hk, dtype=dt, device=dP.device)   # d(pre-activation of k_{t+1})
        M0t = M0.mT.contiguous()
        dG_suffix = torch.zeros(B, H, dtype=dt, device=dP.device)
    dg = ds_end if ds_end is not None else torch.zeros(B, d, dtype=dt, device=dP.device)
    for tau in range(C - 1, -1, -1):
        # Ground: s_next = gate * p + fuse.
        p, gate = acts.p[tau], acts.gate[tau]
        d_fuse[:, tau] = dg
        dyfg = dg * p * gate * (1 - gate)
        dYfg[tau] = dyfg
        dc = dP[:, tau] + gate * dg + _rms_back(acts.n_p[tau], p, _mm_t(dyfg, Wt.w_fg), eps)
        for i in range(L - 1, -1, -1):
            c_in, n_in = acts.c[i][tau], acts.n[i][tau]
            parts = torch.split(acts.y[i][tau], plan.in_splits[i], dim=-1)
            dparts = list(torch.split(dY[i][tau], plan.in_splits[i], dim=-1))  # views into dY
            pg = parts[-1]
            sg = torch.sigmoid(pg)
            dZ[i][tau] = dc
            dparts[-1].copy_(dc * c_in * sg * (1 - sg))
            dc_in = dc * sg
            dh = _mm_t(dc, Wt.w_out[i])
            fa, fb = parts[-2].chunk(2, dim=-1)
            dfa, dfb = dparts[-2].chunk(2, dim=-1)
            dh_ffn = dh[:, -plan.f:]
            dfa.copy_(_silu_back(fa, dh_ffn * fb))
            dfb.copy_(dh_ffn * F.silu(fa))
            if mem:
                q_pre, rg = parts[-4], parts[-3]
                ro = acts.ro[i][tau]
                dh_read = dh[:, :Hv]
                dparts[-3].copy_(_silu_back(rg, dh_read * ro))
                do = _rms_back(ro, acts.o[i][tau], dh_read * F.silu(rg), eps).view(B, H, dv)
                # Read after write: o = e^{G_t} M0^T q + sum_{j<=t} e^{G_t - G_j} (q.k_j) u_j.
                q = acts.q[i][:, :, tau]
                Gt = G[..., tau]
                eG = Gt.exp()
                drq = eG[..., None] * do
                dRq[i][:, :, tau] = drq
                dq = (drq[:, :, None] @ M0t)[:, :, 0]
                dGt = eG * (do * acts.rq[i][:, :, tau]).sum(-1)
                Kh, Uh = K[:, :, :tau + 1], U[:, :, :tau + 1]
                w = (Gt[..., None] - G[..., :tau + 1]).exp()
                sdot = (Kh @ q[..., None])[..., 0]
                da = (Uh @ do[..., None])[..., 0]
                dU[:, :, :tau + 1] += (w * sdot)[..., None] * do[:, :, None]
                dsd = da * w
                dq = dq + (dsd[:, :, None] @ Kh)[:, :, 0]
                dK[:, :, :tau + 1] += dsd[..., None] * q[:, :, None]
                dw = dsd * sdot
                dG[..., :tau + 1] -= dw
                dG[..., tau] += dGt + dw.sum(-1)
                dparts[-4].copy_(_l2n_back(q_pre.view(B, H, dk), dq).view(B, Hk))
            if mem and i == 0:
                _write_backward(plan, Wt, acts, M0t, tau, parts, dparts, dK, dU, dG, dRk,
                                dk_next_pre, dG_suffix, dA)
                dk_pre = _l2n_back(acts.k_pre[tau].view(B, H, dk), dK[:, :, tau]).view(B, Hk)
                if tau:
                    dk_next_pre = dk_pre
                else:
                    dk_pre0 = dk_pre
            dc = dc_in + _rms_back(n_in, c_in, _mm_t(dY[i][tau], Wt.w_in[i]), eps)
        dc = dc + ds_extra[tau]
        dg = dc                                         # gradient of the state entering step tau
    return dg, dk_pre0


def _write_backward(plan: _Plan, W: _LoopWeights, acts: _ChunkActs, M0t: Tensor, tau: int,
                    parts: tuple[Tensor, ...], dparts: list[Tensor], dK: Tensor, dU: Tensor,
                    dG: Tensor, dRk: Tensor, dk_next_pre: Tensor, dG_suffix: Tensor,
                    dA: Tensor) -> None:
    """Step tau's memory write, reversed: u_t = beta (v - M_{t-1}^T k_t) and the decay.

    Fills the write blocks of layer 0's input gradient (`dparts`) and adds to the chunk's
    adjoints of k, u and G (dK, dU, dG) and to dA; dG_suffix is updated in place.
    """
    B, H, dv = dK.shape[0], plan.H, plan.dv
    G = acts.G
    du = dU[:, :, tau]
    beta = acts.beta[..., tau]
    dparts[0].copy_(dk_next_pre)                     # k_{t+1} is computed at step t
    dparts[2].copy_((du * (acts.v[:, :, tau] - acts.pred[:, :, tau])).sum(-1)
                    * beta * (1 - beta))
    dvv = beta[..., None] * du
    dparts[1].copy_(dvv.reshape(B, H * dv))
    dpred = -dvv
    # pred = e^{G_{t-1}} M0^T k_t + sum_{j<t} e^{G_{t-1} - G_j} (k_t.k_j) u_j
    k = acts.k[:, :, tau]
    G_prev = G[..., tau - 1] if tau else torch.zeros_like(G[..., 0])
    eGp = G_prev.exp()
    drk = eGp[..., None] * dpred
    dRk[:, :, tau] = drk
    dk = (drk[:, :, None] @ M0t)[:, :, 0]
    if tau:
        dGp = eGp * (dpred * acts.rk[:, :, tau]).sum(-1)
        Kh, Uh = acts.k[:, :, :tau], acts.U[:, :, :tau]
        w = (G_prev[..., None] - G[..., :tau]).exp()
        sdot = (Kh @ k[..., None])[..., 0]
        da = (Uh @ dpred[..., None])[..., 0]
        dU[:, :, :tau] += (w * sdot)[..., None] * dpred[:, :, None]
        dsd = da * w
        dk = dk + (dsd[:, :, None] @ Kh)[:, :, 0]
        dK[:, :, :tau] += dsd[..., None] * k[:, :, None]
        dw = dsd * sdot
        dG[..., :tau] -= dw
        dG[..., tau - 1] += dGp + dw.sum(-1)
    dK[:, :, tau] += dk
    # G_t = G_{t-1} + log a_t, so d log a_t = sum over t' >= t of dG_t' (complete by now).
    dG_suffix += dG[..., tau]
    decay_pre = parts[3]
    dparts[3].copy_(dG_suffix * (-W.A) * torch.sigmoid(decay_pre))
    dA -= (dG_suffix * F.softplus(decay_pre)).sum(0)


def _forward_chunks(plan: _Plan, W: _LoopWeights, kernels, fuse: Tensor, s: Tensor,
                    s_prev: Tensor, M: Tensor | None, P: Tensor, S: Tensor | None,
                    carries: list) -> None:
    """The no-grad forward over all chunks; appends each chunk's start carry to `carries`
    (and, last, the final carry); fills P and, when given, S (the state entering each step).
    `kernels`: the fused CPU step kernels, or None for the PyTorch steps."""
    for start, end in plan.spans:
        carries.append((s, s_prev, M))
        S_chunk = None if S is None else S[:, start:end]
        if kernels is not None:
            s, s_prev, M = _run_chunk_fused(plan, W, kernels, fuse[:, start:end], s, s_prev, M,
                                            P[:, start:end], S_chunk)
        else:
            P[:, start:end], s, s_prev, M = _run_chunk(plan, W, fuse[:, start:end], s, s_prev,
                                                       M, S_chunk)
    carries.append((s, s_prev, M))


class _SequenceFunction(torch.autograd.Function):
    """fuse (B, T, d), initial carry, loop weights -> P (B, T, d), final carry."""

    @staticmethod
    def forward(ctx, plan: _Plan, fuse: Tensor, s0: Tensor, s_prev0: Tensor,
                M0: Tensor | None, *flat: Tensor):  # type: ignore[override]
        W = _LoopWeights.unflat(plan, flat).for_matmul(plan.mm_dtype)
        B, T, d = fuse.shape
        P = fuse.new_empty(B, T, d)
        # The state entering each step, O(T*d): what the backward recomputes each chunk from.
        S = fuse.new_empty(B, T, d) if any(ctx.needs_input_grad) else None
        carries: list = []
        kernels = kernels_for(fuse.device)
        with _phase("sequential forward"):
            _forward_chunks(plan, W, kernels, fuse, s0, s_prev0, M0, P, S, carries)
        s, s_prev, M = carries.pop()
        ctx.plan = plan
        ctx.kernels = kernels
        ctx.carries = carries
        ctx.fuse_meta = (fuse.shape, fuse.dtype, fuse.device)   # its values are not needed
        ctx.save_for_backward(S, *flat)
        if M is None:
            M = fuse.new_zeros(0)
            ctx.mark_non_differentiable(M)
        return P, s, s_prev, M

    @staticmethod
    def backward(ctx, dP: Tensor, ds: Tensor, ds_prev: Tensor, dM: Tensor):  # type: ignore[override]
        plan: _Plan = ctx.plan
        dP = dP.contiguous()
        S, *flat = ctx.saved_tensors
        shape, dtype, device = ctx.fuse_meta
        W = _LoopWeights.unflat(plan, [t.detach() for t in flat])
        Wt = W.for_matmul(plan.mm_dtype).transposed()
        # The recompute reads the same copies as the sweep, as views (its chunk-wide GEMMs run
        # as fast on them): the backward streams one copy of the loop weights instead of two,
        # and the sweep's first steps of each chunk find more of them still in cache.
        Wrec = Wt.untransposed_views()
        grads = _Grads.zeros_like(W, dtype)
        d_fuse = torch.empty(shape, dtype=dtype, device=device)
        d_carry: tuple[Tensor | None, ...] = (ds, ds_prev, dM if plan.memory else None)
        workspace = _Workspace(max(end - start for start, end in plan.spans), device)
        for idx in range(len(plan.spans) - 1, -1, -1):
            start, end = plan.spans[idx]
            if end in plan.cuts:  # truncated BPTT: nothing flows back across this point
                d_carry = (None, None, None)
            _, s_prev, M = ctx.carries[idx]
            with _phase("parallel recompute"):
                acts = _recompute_chunk(plan, Wrec, S[:, start:end], s_prev, M)
            d_carry = _chunk_backward(plan, Wt, acts, M, dP[:, start:end], *d_carry, grads,
                                      d_fuse[:, start:end], ctx.kernels, workspace)
        weight_grads = [g.to(w.dtype) for g, w in zip(grads.flat(), flat)]
        ds0, ds_prev0, dM0 = d_carry
        return (None, d_fuse, ds0, ds_prev0, dM0 if ctx.needs_input_grad[4] else None,
                *weight_grads)


def _matmul(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight (+ bias) in the weight's dtype (bf16 under autocast), result in x's dtype."""
    if weight.dtype != x.dtype:
        y = (x.to(weight.dtype) @ weight).to(x.dtype)
        return y if bias is None else y + bias
    if bias is None:
        return x @ weight
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], -1)


# ------------------------------------------------------------------ entry point
def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, mm_dtype: torch.dtype | None
            ) -> Tensor:
    """F.linear in the matmul dtype (if any), result back in x's dtype."""
    if mm_dtype is None:
        return F.linear(x, weight, bias)
    y = F.linear(x.to(mm_dtype), weight.to(mm_dtype)).to(x.dtype)
    return y if bias is None else y + bias


def run_engine(model: GPN, tokens: Tensor, state: GPNState | None, *,
               return_state: bool = False, return_logits: bool = False) -> GPNOutput:
    """The model's forward: see the module docstring."""
    cfg = model.config
    if tokens.dim() != 2:
        raise ValueError(f"tokens: expected shape (batch, time), got {tuple(tokens.shape)}")
    B, T = tokens.shape
    device = tokens.device
    mm_dtype = _autocast_dtype(device)
    with torch.autocast(device.type, enabled=False):
        if state is None:
            state = model.initial_state(B, device)
        sdt = model.state_dtype()
        eps = cfg.norm_eps
        E = model.embedding.weight
        emb = F.embedding(tokens, E)
        fuse = _linear(_rms(emb.to(sdt), eps) * model.fuse_norm_weight, model.fuse.weight, None,
                       mm_dtype)
        spans, cuts = make_spans(T, cfg.chunk_size, cfg.tbptt)
        plan = _Plan(cfg.n_layers, cfg.memory, cfg.n_heads, cfg.d_key, cfg.d_value, cfg.d_state,
                     cfg.d_ffn, eps, spans, cuts, mm_dtype,
                     tuple(input_column_blocks(cfg, i) for i in range(cfg.n_layers)))
        weights = fold_loop_weights(model).flat()
        P, s, s_prev, M = _SequenceFunction.apply(
            plan, fuse, state.s.to(sdt), state.s_prev.to(sdt),
            None if state.memory is None else state.memory.to(sdt), *weights)
        with _phase("decode"):
            loss = chunked_decode_cross_entropy(
                P.reshape(B * T, -1), model.decode_norm_weight, model.decode.weight,
                model.decode.bias, E, tokens.reshape(B * T), cfg.loss_chunk_tokens, eps,
                mm_dtype, scale=1.0 / (B * T))
        logits = None
        if return_logits:   # tests and analysis only: the full (B, T, V) block
            h = _linear(_rms(P, eps) * model.decode_norm_weight, model.decode.weight,
                        model.decode.bias, mm_dtype)
            logits = _linear(h, E, None, mm_dtype)
    final = GPNState(s, s_prev, M if cfg.memory else None) if return_state else None
    return GPNOutput(loss=loss, state=final, logits=logits)
