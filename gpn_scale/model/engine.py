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
   - backward is chunk by chunk in reverse with recomputation: saved are the per-step
     outputs p_t (O(T*d)) and one carry (s, s_prev, M) per chunk; weight gradients (and
     dM0) are one large matmul per chunk (`ops/deferred.py`), not a rank-B update per step.
3. Outside the loop again: decode and cross-entropy in chunks of positions
   (`model/loss.py`), never the full B x T x V logits.

Under torch.autocast the large matmuls run in the autocast dtype; the state, the memory
and every elementwise recurrence op stay in float32.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from gpn_scale.model.config import GPNConfig
from gpn_scale.model.gpn import GPN, GPNOutput, GPNState
from gpn_scale.model.loss import chunked_linear_cross_entropy
from gpn_scale.ops.deferred import DeferredSlot, _matmul, deferred_matmul
from gpn_scale.ops.memory import chunk_errors, chunk_read


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
    def unflat(plan: _Plan, flat: list[Tensor] | tuple[Tensor, ...]) -> "_LoopWeights":
        L = plan.n_layers
        return _LoopWeights(list(flat[:L]), list(flat[L:2 * L]), list(flat[2 * L:3 * L]),
                            flat[3 * L], flat[3 * L + 1], flat[3 * L + 2] if plan.memory else None)

    def for_matmul(self, dtype: torch.dtype | None) -> "_LoopWeights":
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


class _Slots:
    """One DeferredSlot per loop weight (None everywhere in the no-grad forward).

    With `replay`, the slots of the large per-step matmuls return values precomputed for the
    whole chunk (see `_precompute_chunk`).
    """

    def __init__(self, plan: _Plan, record: bool, replay: "_Replay | None" = None) -> None:
        L = plan.n_layers
        if not record:
            self.key0 = self.fg = self.memory = None
            self.w_in: list[DeferredSlot | None] = [None] * L
            self.w_out: list[DeferredSlot | None] = [None] * L
            return
        self.key0 = DeferredSlot()              # first key of a chunk, from s_prev
        self.memory = DeferredSlot()            # reads of the chunk-start memory M0
        self.w_in = [DeferredSlot(replay.y_in[i] if replay else None) for i in range(L)]
        self.w_out = [DeferredSlot(replay.z[i] if replay else None) for i in range(L)]
        self.fg = DeferredSlot(replay.fg if replay else None)


@dataclass
class _Replay:
    """Outputs of a chunk's per-step matmuls, each (C, B, N), computed in large matmuls."""

    y_in: list[Tensor]
    z: list[Tensor]
    fg: Tensor


@torch.no_grad()
def _precompute_chunk(plan: _Plan, W: _LoopWeights, S: Tensor, s_prev: Tensor,
                      M0: Tensor | None) -> _Replay:
    """Given the chunk's states S (B, C, d) from the forward, every matmul of the chunk at once.

    All inputs of every step are known here, so each projection is ONE (C*B)-row matmul and
    the memory is the fully parallel chunk form (`ops.memory`, use 1).
    """
    B, C, d = S.shape
    H, dk, dv, eps = plan.H, plan.dk, plan.dv, plan.eps
    c = S.transpose(0, 1)                                          # (C, B, d)
    y_in, z = [], []
    for i in range(plan.n_layers):
        y = _matmul(_rms(c, eps), W.w_in[i], W.b_in[i])
        y_in.append(y)
        parts = torch.split(y, plan.in_splits[i], dim=-1)
        if plan.memory and i == 0:
            k_next_pre, v, beta_pre, decay_pre, q_pre, rg, ffn_in, pg = parts
            k_cols = H * dk
            k_first = _matmul(_rms(s_prev, eps), W.w_in[0][:, :k_cols], W.b_in[0][:k_cols])
            k_pre = torch.cat([k_first[None], k_next_pre[:-1]], dim=0)
            k = _heads(_l2n(F.relu(k_pre).view(C, B, H, dk)))
            log_a = (-W.A * F.softplus(decay_pre)).permute(1, 2, 0)          # (B, H, C)
            beta = torch.sigmoid(beta_pre).permute(1, 2, 0)
            U, G = chunk_errors(k, _heads(v.view(C, B, H, dv)), log_a, beta, M0, "gpn")
        elif plan.memory:
            q_pre, rg, ffn_in, pg = parts
        else:
            ffn_in, pg = parts
        a, b = ffn_in.chunk(2, dim=-1)
        hidden = F.silu(a) * b
        if plan.memory:
            q = _heads(_l2n(F.relu(q_pre).view(C, B, H, dk)))
            o = chunk_read(q, k, U, G, M0).permute(2, 0, 1, 3).reshape(C, B, H * dv)
            hidden = torch.cat([F.silu(rg) * _rms(o, eps), hidden], dim=-1)
        z.append(_matmul(hidden, W.w_out[i], None))
        c = torch.sigmoid(pg) * c + z[-1]
    return _Replay(y_in, z, _matmul(_rms(c, eps), W.w_fg, W.b_fg))


def _heads(x: Tensor) -> Tensor:
    """(C, B, H, n) -> (B, H, C, n)."""
    return x.permute(1, 2, 0, 3)


class _ChunkHistory:
    """The chunk's k_j, u_j, G_j so far. Without autograd they go into preallocated buffers
    (no copying of the history each step); under autograd, into lists stacked on demand
    (autograd forbids overwriting tensors that earlier steps saved)."""

    def __init__(self, B: int, H: int, C: int, dk: int, dv: int, like: Tensor, buffered: bool
                 ) -> None:
        self.buffered = buffered
        if buffered:
            self.K = like.new_empty(B, H, C, dk)
            self.U = like.new_empty(B, H, C, dv)
            self.G = like.new_empty(B, H, C)
        else:
            self.keys: list[Tensor] = []
            self.errs: list[Tensor] = []
            self.cums: list[Tensor] = []

    def append(self, tau: int, k: Tensor, u: Tensor, G: Tensor) -> None:
        if self.buffered:
            self.K[:, :, tau] = k
            self.U[:, :, tau] = u
            self.G[:, :, tau] = G
        else:
            self.keys.append(k)
            self.errs.append(u)
            self.cums.append(G)

    def upto(self, n: int) -> tuple[Tensor, Tensor, Tensor]:
        if self.buffered:
            return self.K[:, :, :n], self.U[:, :, :n], self.G[:, :, :n]
        return (torch.stack(self.keys[:n], dim=2), torch.stack(self.errs[:n], dim=2),
                torch.stack(self.cums[:n], dim=2))


def _run_chunk(plan: _Plan, W: _LoopWeights, fuse: Tensor, s: Tensor, s_prev: Tensor,
               M0: Tensor | None, slots: _Slots, inputs: list[Tensor] | None = None
               ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Steps of one chunk. fuse: (B, C, d). Returns (P (B, C, d), s, s_prev, M_end).

    `inputs`, when given, receives the state s entering every step.
    """
    B, C, _ = fuse.shape
    H, dk, dv, eps = plan.H, plan.dk, plan.dv, plan.eps
    mem = plan.memory
    if mem:
        k_cols = H * dk
        k_pre = deferred_matmul(_rms(s_prev, eps), W.w_in[0][:, :k_cols], W.b_in[0][:k_cols],
                                slots.key0)
        k = _l2n(F.relu(k_pre).view(B, H, dk))
        history = _ChunkHistory(B, H, C, dk, dv, s, buffered=slots.memory is None)
        G_prev = s.new_zeros(B, H)
    outputs = []
    for tau in range(C):
        if inputs is not None:
            inputs.append(s)
        c = s
        for i in range(plan.n_layers):
            y = deferred_matmul(_rms(c, eps), W.w_in[i], W.b_in[i], slots.w_in[i])
            parts = torch.split(y, plan.in_splits[i], dim=-1)
            if mem and i == 0:
                k_next_pre, v, beta_pre, decay_pre, q_pre, rg, ffn_in, pg = parts
                v = v.view(B, H, dv)
                log_a = -W.A * F.softplus(decay_pre)
                G = G_prev + log_a
                q = _l2n(F.relu(q_pre).view(B, H, dk))
                # One read of M0 for the key (error term) and the query (read after write).
                kq = torch.stack([k, q], dim=2)
                r = deferred_matmul(kq, M0, None, slots.memory)
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
                r = deferred_matmul(q[:, :, None], M0, None, slots.memory)[:, :, 0]
                K, U, Gj = history.upto(tau + 1)
                w = (q[:, :, None] @ K.mT) * (G[..., None, None] - Gj[:, :, None, :]).exp()
                o = G.exp()[..., None] * r + (w @ U)[:, :, 0]
            else:
                ffn_in, pg = parts
            a, b = ffn_in.chunk(2, dim=-1)
            hidden = F.silu(a) * b
            if mem:
                hidden = torch.cat([F.silu(rg) * _rms(o.reshape(B, H * dv), eps), hidden], dim=-1)
            c = torch.sigmoid(pg) * c + deferred_matmul(hidden, W.w_out[i], None, slots.w_out[i])
        p = c
        gate = torch.sigmoid(deferred_matmul(_rms(p, eps), W.w_fg, W.b_fg, slots.fg))
        outputs.append(p)
        s_prev, s = s, gate * p + fuse[:, tau]
    M_end = None
    if mem:
        K, U, Gj = history.upto(C)
        G_end = Gj[..., -1:]
        M_end = G_end.exp()[..., None] * M0 + (K * (G_end - Gj).exp()[..., None]).mT @ U
    return torch.stack(outputs, dim=1), s, s_prev, M_end


def _forward_chunks(plan: _Plan, W: _LoopWeights, fuse: Tensor, s: Tensor, s_prev: Tensor,
                    M: Tensor | None, slots: _Slots, P: Tensor, S: Tensor | None,
                    carries: list) -> None:
    """The no-grad forward over all chunks; appends each chunk's start carry to `carries`
    (and, last, the final carry); fills P and, when given, S (the state entering each step)."""
    for start, end in plan.spans:
        carries.append((s, s_prev, M))
        inputs: list[Tensor] | None = [] if S is not None else None
        P[:, start:end], s, s_prev, M = _run_chunk(plan, W, fuse[:, start:end], s, s_prev, M,
                                                   slots, inputs)
        if S is not None:
            S[:, start:end] = torch.stack(inputs, dim=1)
    carries.append((s, s_prev, M))


class _SequenceFunction(torch.autograd.Function):
    """fuse (B, T, d), initial carry, loop weights -> P (B, T, d), final carry."""

    @staticmethod
    def forward(ctx, plan: _Plan, fuse: Tensor, s0: Tensor, s_prev0: Tensor,
                M0: Tensor | None, *flat: Tensor):  # type: ignore[override]
        W = _LoopWeights.unflat(plan, flat).for_matmul(plan.mm_dtype)
        B, T, d = fuse.shape
        P = fuse.new_empty(B, T, d)
        need_backward = any(ctx.needs_input_grad)
        S = fuse.new_empty(B, T, d) if need_backward else None   # the state entering each step
        s, s_prev, M = s0, s_prev0, M0
        carries = []
        no_slots = _Slots(plan, record=False)
        with _phase("sequential forward"):
            _forward_chunks(plan, W, fuse, s, s_prev, M, no_slots, P, S, carries)
        s, s_prev, M = carries.pop()
        ctx.plan = plan
        ctx.carries = carries
        ctx.save_for_backward(fuse, S, *flat)
        if M is None:
            M = fuse.new_zeros(0)
            ctx.mark_non_differentiable(M)
        return P, s, s_prev, M

    @staticmethod
    def backward(ctx, dP: Tensor, ds: Tensor, ds_prev: Tensor, dM: Tensor):  # type: ignore[override]
        plan: _Plan = ctx.plan
        fuse, S, *flat = ctx.saved_tensors
        # Detached: the recompute below must not reach into the graph that built the weights.
        W = _LoopWeights.unflat(plan, [t.detach() for t in flat])
        Wmm = W.for_matmul(plan.mm_dtype)
        acc = fuse.dtype
        g_w_in = [torch.zeros_like(w, dtype=acc) for w in W.w_in]
        g_b_in = [torch.zeros_like(b, dtype=acc) for b in W.b_in]
        g_w_out = [torch.zeros_like(w, dtype=acc) for w in W.w_out]
        g_w_fg = torch.zeros_like(W.w_fg, dtype=acc)
        g_b_fg = torch.zeros_like(W.b_fg, dtype=acc)
        g_A = torch.zeros_like(W.A, dtype=acc) if W.A is not None else None
        d_fuse = torch.empty_like(fuse)
        d_carry: tuple[Tensor | None, ...] = (ds, ds_prev, dM if plan.memory else None)
        k_cols = plan.H * plan.dk

        for idx in range(len(plan.spans) - 1, -1, -1):
            start, end = plan.spans[idx]
            if end in plan.cuts:  # truncated BPTT: nothing flows back across this point
                d_carry = (None, None, None)
            s, s_prev, M = (None if t is None else t.detach().requires_grad_()
                            for t in ctx.carries[idx])
            fuse_c = fuse[:, start:end].detach().requires_grad_()
            A_leaf = None if W.A is None else W.A.detach().requires_grad_()
            Wc = _LoopWeights(Wmm.w_in, Wmm.b_in, Wmm.w_out, Wmm.w_fg, Wmm.b_fg, A_leaf)
            # Every matmul of the chunk in a few large GEMMs; the sequential recompute below
            # replays their outputs, so it only runs the cheap elementwise/memory steps.
            with _phase("parallel recompute"):
                replay = _precompute_chunk(plan, Wmm, S[:, start:end], ctx.carries[idx][1],
                                           ctx.carries[idx][2])
            slots = _Slots(plan, record=True, replay=replay)
            with _phase("sequential backward"), torch.enable_grad():
                P_c, s_end, s_prev_end, M_end = _run_chunk(plan, Wc, fuse_c, s, s_prev, M, slots)
                outs, grads = [P_c], [dP[:, start:end]]
                for out, grad in zip((s_end, s_prev_end, M_end), d_carry):
                    if out is not None and grad is not None and out.requires_grad:
                        outs.append(out)
                        grads.append(grad)
                torch.autograd.backward(outs, grads)

            with _phase("weight gradients"):
                for i in range(plan.n_layers):
                    _accumulate(slots.w_in[i], g_w_in[i], g_b_in[i])
                    _accumulate(slots.w_out[i], g_w_out[i], None)
                _accumulate(slots.fg, g_w_fg, g_b_fg)
                if plan.memory:
                    _accumulate(slots.key0, g_w_in[0][:, :k_cols], g_b_in[0][:k_cols])
                    g_A += A_leaf.grad
                dM0 = None
                if M is not None:
                    dM0 = _grad_or_zeros(M)
                    deferred = slots.memory.weight_grad(acc)
                    if deferred is not None:
                        dM0 = dM0 + deferred[0]
            d_fuse[:, start:end] = _grad_or_zeros(fuse_c)
            d_carry = (_grad_or_zeros(s), _grad_or_zeros(s_prev), dM0)

        weight_grads = [*g_w_in, *g_b_in, *g_w_out, g_w_fg, g_b_fg,
                        *([g_A] if g_A is not None else [])]
        weight_grads = [g.to(w.dtype) for g, w in zip(weight_grads, flat)]
        ds0, ds_prev0, dM0 = d_carry
        return (None, d_fuse, ds0, ds_prev0, dM0 if ctx.needs_input_grad[4] else None,
                *weight_grads)


def _grad_or_zeros(leaf: Tensor) -> Tensor:
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def _accumulate(slot: DeferredSlot, g_w: Tensor, g_b: Tensor | None) -> None:
    result = slot.weight_grad(g_w.dtype)
    if result is None:
        return
    dW, db = result
    g_w += dW
    if g_b is not None:
        g_b += db


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
            h = _linear(_rms(P, eps) * model.decode_norm_weight, model.decode.weight,
                        model.decode.bias, mm_dtype)
            flat_h = h.reshape(B * T, -1)
            targets = tokens.reshape(B * T)
            loss = chunked_linear_cross_entropy(flat_h, E, targets, cfg.loss_chunk_tokens,
                                                mm_dtype) / (B * T)
        logits = None
        if return_logits:
            logits = _linear(h, E, None, mm_dtype).view(B, T, -1)
    final = GPNState(s, s_prev, M if cfg.memory else None) if return_state else None
    return GPNOutput(loss=loss, state=final, logits=logits)
