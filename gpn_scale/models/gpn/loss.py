"""Decode + tied-output cross-entropy over many positions, without materialising the logits.

    loss_sum = sum_n CE((rms(p_n) * w) @ W_dec^T + b) @ E^T, y_n)

is computed `rows` positions at a time, and the gradients with respect to p, w, W_dec, b
and E are formed in the same pass (softmax - onehot, then one matmul each), so peak memory
is one (rows x V) block, never (N x V), and nothing of size N is kept for the backward but
dL/dp. Hand-written because torch has no fused linear + cross-entropy op; the slow form it
equals (tested) is F.cross_entropy(decode(p) @ E.T, y, reduction="sum").

Vocabulary-parallel form (tensor parallelism, `tp_group` given; E is then this rank's
(V/tp, e) rows, Megatron's vocab_parallel_cross_entropy done block by block): per block
h = decode(p) is computed on every rank (replicated: rows x e), the logits only for the
local vocabulary (rows x V/tp), their row max all-reduced (MAX, rows floats), then the sum
of exp and the target's logit (held by one rank, the others add 0) in one all-reduce of
(rows, 2); the loss is the same on every rank. Backward in the same pass: softmax - onehot
of the local columns, dE_local = g^T h on this rank alone, dh = g @ E_local summed over the
group (rows x e), and W_dec, b, the norm and P from the full dh as without tp. No rank ever
holds more than (rows x V/tp) logits. megatron-core's function is not used: it takes the
whole logits tensor and megatron's global tp group, and keeps the softmax for a separate
backward, where here each block's gradients (the tied E included) are formed at once.

The pass is fed in pieces (`DecodePass.add`): the engine feeds each stretch of chunks'
predicted states as soon as the sequence op has made them (`ChunkFeed`), beside the next
chunk's forward steps on CUDA; the loss and gradients depend only on the pieces and their
order, not on where or when they ran.

The block after the decode (logits, softmax cross-entropy, dh and dE, the vocabulary-parallel
form included) is `gpn_scale.models.linear_cross_entropy.cross_entropy_block`, which the
baseline families' head loss runs too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gpn_scale.models.gpn.vocab_parallel import vocab_start
from gpn_scale.models.linear_cross_entropy import cross_entropy_block
from gpn_scale.ops.gpn_step import fused
from gpn_scale.ops.gpn_step.functional import add_product_
from gpn_scale.ops.gpn_step.overlap import Future, SideWork
from gpn_scale.ops.gpn_step.phases import phase


class DecodePass:
    """One pass of decode + cross-entropy over a window's positions, fed piece by piece (`add`,
    in a fixed order), every gradient formed as it goes (unscaled: `decode_cross_entropy`
    scales them and hands them to autograd).

    The engine feeds it each chunk's predicted states as the sequence op makes them (beside
    the next chunk's forward steps, `ChunkFeed`); `chunked_decode_cross_entropy` feeds it all
    positions at once. The sums run over the pieces in the order fed, so a pass fed the same
    pieces gives the same bits wherever the pieces ran."""

    @torch.no_grad()
    def __init__(
        self,
        norm_w: Tensor,
        W_dec: Tensor,
        b_dec: Tensor | None,
        E: Tensor,
        rows: int,
        eps: float,
        mm_dtype: torch.dtype | None,
        need_grad: bool,
        tp_group: Any,
        state_dtype: torch.dtype,
    ) -> None:
        if rows < 1:
            raise ValueError(f"rows: must be >= 1, got {rows}")
        self.acc = acc = torch.float64 if state_dtype == torch.float64 else torch.float32
        mm = mm_dtype or state_dtype
        self.norm_w, self.b = norm_w, None if b_dec is None else b_dec.to(mm)
        self.Em, self.Wm = E.to(mm), W_dec.to(mm)
        self.rows, self.eps, self.mm, self.tp_group = rows, eps, mm, tp_group
        self.v_start = vocab_start(E, tp_group)
        device = E.device
        self.total = torch.zeros((), dtype=acc, device=device)
        self.grads: tuple[Tensor, Tensor, Tensor, Tensor] | None = None  # dw, dW, db, dE
        if need_grad:
            self.grads = (
                torch.zeros(norm_w.shape, dtype=acc, device=device),
                torch.zeros(W_dec.shape, dtype=acc, device=device),
                torch.zeros(W_dec.shape[0], dtype=acc, device=device),
                torch.zeros(E.shape, dtype=acc, device=device),
            )

    def tensors(self) -> list[Tensor]:
        """What the pass reads and adds to (for a side stream's `record_stream`)."""
        held = [self.norm_w, self.Em, self.Wm, self.total, *(self.grads or ())]
        return held if self.b is None else [*held, self.b]

    @torch.no_grad()
    def add(self, P: Tensor, targets: Tensor, dP: Tensor | None = None) -> None:
        """Add the positions P (n, d) with their targets (n,); with gradients, write the loss's
        (unscaled) gradient with respect to P into dP (n, d)."""
        dw, dW, db, dE = self.grads if self.grads is not None else (None,) * 4
        for start in range(0, P.shape[0], self.rows):
            p = P[start : start + self.rows]
            # n = rms(p), its rows' scales r, nw = n * norm_w in the matmul dtype: one kernel
            # on CUDA (ops/gpn_step/fused.py), the PyTorch ops elsewhere
            n, nw, r = fused.weighted_rms(p, self.eps, self.norm_w, self.mm)
            h = nw @ self.Wm.t()
            if self.b is not None:
                h = h + self.b
            dh = cross_entropy_block(
                h,
                self.Em,
                targets[start : start + self.rows],
                self.acc,
                self.grads is not None,
                self.total,
                dE,
                self.tp_group,
                self.v_start,
            )
            if dh is None:
                continue
            assert dP is not None and dw is not None and dW is not None and db is not None
            add_product_(dW, dh.t(), nw)
            db += dh.sum(0).to(self.acc)
            dnw = (dh @ self.Wm).to(P.dtype)
            dw += (dnw * n).sum(0).to(self.acc)
            fused.rms_back(dnw, n, r, self.norm_w, dP[start : start + self.rows])


class _DecodeCrossEntropy(torch.autograd.Function):
    """(P, the decode's and E's parameters) -> the scaled loss of a fed `DecodePass`; its
    backward hands out the gradients the pass formed, times the incoming gradient."""

    @staticmethod
    def forward(
        ctx,
        P: Tensor,
        norm_w: Tensor,
        W_dec: Tensor,
        b_dec: Tensor | None,
        E: Tensor,
        finish: Callable[[], tuple[DecodePass, Tensor | None]],
        scale: float,
    ) -> Tensor:
        decode, dP = finish()
        if decode.grads is not None:
            assert dP is not None
            dw, dW, db, dE = decode.grads
            for g in (dP, dw, dW, db, dE):
                g.mul_(scale)
            ctx.save_for_backward(dP, dw, dW, db, dE)
            ctx.has_bias = b_dec is not None
            ctx.dtypes = (norm_w.dtype, W_dec.dtype, E.dtype)
        return decode.total * scale

    @staticmethod
    def backward(ctx, d_total: Tensor):
        dP, dw, dW, db, dE = ctx.saved_tensors
        w_dt, W_dt, E_dt = ctx.dtypes
        # Always scaled on the device: testing d_total == 1 to skip the (N x d) product cost a
        # host sync every micro-batch (x * 1.0 == x exactly, so results are unchanged), and
        # the loop's loss / accum makes it != 1 whenever gradients accumulate anyway. Not in
        # place, so that repeated backwards (retain_graph) stay correct.
        return (
            dP * d_total.to(dP.dtype),
            (dw * d_total).to(w_dt),
            (dW * d_total).to(W_dt),
            (db * d_total).to(W_dt) if ctx.has_bias else None,
            (dE * d_total).to(E_dt),
            None,
            None,
        )


def needs_grad(*tensors: Tensor | None) -> bool:
    """Whether a loss of these tensors needs its gradients formed (the caller's grad mode,
    read before the pass runs: held-out evaluation runs it under torch.no_grad())."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def decode_cross_entropy(
    P: Tensor,
    norm_w: Tensor,
    W_dec: Tensor,
    b_dec: Tensor | None,
    E: Tensor,
    finish: Callable[[], tuple[DecodePass, Tensor | None]],
    scale: float,
) -> Tensor:
    """`scale` x the loss of the pass `finish()` returns fed (with dL/dP in P's shape when it
    formed gradients), differentiable in P and the parameters (the engine's form)."""
    return _DecodeCrossEntropy.apply(P, norm_w, W_dec, b_dec, E, finish, scale)


def chunked_decode_cross_entropy(
    P: Tensor,
    norm_w: Tensor,
    W_dec: Tensor,
    b_dec: Tensor | None,
    E: Tensor,
    targets: Tensor,
    rows: int = 1024,
    eps: float = 1e-6,
    mm_dtype: torch.dtype | None = None,
    scale: float = 1.0,
    tp_group: Any = None,
) -> Tensor:
    """`scale` x the sum over positions of CE(decode(P) @ E^T, targets), in one pass.

    P: (N, d) predicted states; norm_w: (d,); W_dec: (e, d) (nn.Linear layout); b_dec: (e,)
    or None; E: (V, e) the tied embedding; targets: (N,). Matmuls run in `mm_dtype` if given.
    With `tp_group` E is this rank's (V/tp, e) rows (rank r: rows r V/tp ..), P, the decoder
    and the targets are the group's (replicated), and so is the returned loss; E's gradient
    is this rank's rows.
    """
    need_grad = needs_grad(P, norm_w, W_dec, b_dec, E)
    decode = DecodePass(norm_w, W_dec, b_dec, E, rows, eps, mm_dtype, need_grad, tp_group, P.dtype)

    def finish() -> tuple[DecodePass, Tensor | None]:
        dP = torch.empty_like(P) if need_grad else None
        decode.add(P, targets, dP)
        return decode, dP

    return decode_cross_entropy(P, norm_w, W_dec, b_dec, E, finish, scale)


class ChunkFeed:
    """The sequence op's chunk hook (`gpn_sequence(on_chunk=...)`) that feeds a `DecodePass`
    each stretch of predicted states once the forward has made them: on a CUDA side stream
    (`engine.overlap_decode`, ops/gpn_step/overlap.py) the decode and loss of chunk k run beside
    the forward steps of chunk k+1, which do not read them.

    A piece is the positions (b-major) of consecutive chunks, at least `rows` of them (the
    last piece: what is left), so the decode's GEMMs stay `rows` tall at small batches.
    The pieces are the same with overlap or without, so the loss and gradients are too."""

    def __init__(self, decode: DecodePass, targets: Tensor, side: SideWork) -> None:
        self.decode, self.targets, self.side = decode, targets, side
        self.first = 0  # the first step not yet fed
        self.pieces: list[Future[None]] = []
        self.dP: Tensor | None = None

    @staticmethod
    def ends_piece(batch: int, first: int, end: int, steps: int, rows: int) -> bool:
        """Whether steps [first, end) of a `steps`-long window make a piece (the accounting
        counts the pieces by this too)."""
        return batch * (end - first) >= rows or end >= steps

    def __call__(self, P: Tensor, start: int, end: int) -> None:
        B, T = self.targets.shape
        if not self.ends_piece(B, self.first, end, T, self.decode.rows):
            return
        if self.decode.grads is not None and self.dP is None:
            self.dP = torch.empty_like(P)
        first, self.first = self.first, end
        reads = [
            P,
            self.targets,
            *self.decode.tensors(),
            *([self.dP] if self.dP is not None else []),
        ]
        self.pieces.append(
            self.side.submit(
                functools.partial(self._piece, P, first, end), after=self.side.mark(), reads=reads
            )
        )

    def _piece(self, P: Tensor, first: int, end: int) -> None:
        with phase("decode", P.device):
            B, _, d = P.shape
            rows = P[:, first:end].reshape(-1, d)
            dp = None if self.dP is None else torch.empty_like(rows)
            self.decode.add(rows, self.targets[:, first:end].reshape(-1), dp)
            if dp is not None:
                assert self.dP is not None
                self.dP[:, first:end] = dp.view(B, end - first, d)

    def finish(self) -> tuple[DecodePass, Tensor | None]:
        """The fed pass and dL/dP (B, T, d), usable on the main stream from here on."""
        for piece in self.pieces:
            self.side.get(piece)
        return self.decode, self.dP
