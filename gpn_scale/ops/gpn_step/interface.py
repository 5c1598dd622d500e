"""The seam between the sequence engine and the backends that run its time steps.

The model's engine (`gpn_scale.models.gpn.engine`) makes the plan and folds the module's
parameters into the loop's fused matrices; the sequence op (`chunk.py`) owns everything
chunk-wide: the parallel recompute, the weight gradients (beside the sweep, `overlap.py`) and
the autograd function. A step backend owns the two sequential parts:

- `forward_chunk`: the C steps of one chunk, no autograd (fills P, and S when asked);
- `reverse_sweep`: one chunk's hand-written reverse sweep, adding into the adjoint buffers.

Every backend computes what `reference.py` (the PyTorch steps) computes; the op-level tests
(tests/ops/test_gpn_step.py) hold each one to it, forward and every gradient.

The fused input matrix of layer i has its column blocks in the order `ColumnLayout` names
(defined here once). The Triton kernels take their offsets from it; the C++ kernels recompute
them (`InCols` in ops/gpn_step/csrc/step_kernels.cpp), and the op-level tests hold the two equal.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol, cast, overload

import torch
from torch import Tensor

from gpn_scale.ops.gpn_step.options import EngineOptions


# ------------------------------------------------------------------ column layout
@dataclass(frozen=True)
class ColumnLayout:
    """Column offsets of one layer's fused input matmul, (start, end) per block; None where the
    layer has no such block. Order: [key(next step), value, beta, decay] (layer 0 of GPN+M:
    the memory write), [query, read gate] (every GPN+M layer), FFN in (a | b), predict gate."""

    key: tuple[int, int] | None
    value: tuple[int, int] | None
    beta: tuple[int, int] | None
    decay: tuple[int, int] | None
    query: tuple[int, int] | None
    read_gate: tuple[int, int] | None
    ffn: tuple[int, int]
    predict_gate: tuple[int, int]
    sizes: tuple[int, ...] = field(repr=False)  # the blocks' widths, for torch.split

    @property
    def width(self) -> int:
        return self.predict_gate[1]

    @staticmethod
    def build(layer: int, memory: bool, H: int, dk: int, dv: int, f: int, d: int) -> ColumnLayout:
        names = []
        if memory and layer == 0:
            names += [("key", H * dk), ("value", H * dv), ("beta", H), ("decay", H)]
        if memory:
            names += [("query", H * dk), ("read_gate", H * dv)]
        names += [("ffn", 2 * f), ("predict_gate", d)]
        spans: dict[str, tuple[int, int]] = {}
        at = 0
        for name, width in names:
            spans[name] = (at, at + width)
            at += width
        blocks = ("key", "value", "beta", "decay", "query", "read_gate", "ffn", "predict_gate")
        optional = {b: spans.get(b) for b in blocks[:6]}
        return ColumnLayout(
            **optional,
            ffn=spans["ffn"],
            predict_gate=spans["predict_gate"],
            sizes=tuple(w for _, w in names),
        )


# ------------------------------------------------------------------------- plan
@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """Static description of one engine call (everything that is not a tensor)."""

    n_layers: int
    memory: bool
    H: int
    dk: int
    dv: int
    d: int
    f: int
    eps: float
    spans: tuple[tuple[int, int], ...]  # chunk boundaries [start, end)
    cuts: frozenset[int]  # positions where truncated BPTT stops gradients
    mm_dtype: torch.dtype | None  # matmul dtype under autocast, else None
    # The engine options (options.py): the step backend asked for, CUDA graphs on or off.
    options: EngineOptions = EngineOptions()
    # Tensor parallelism (`collectives.py`): H and f above are then this rank's share of the
    # heads and FFN hidden units; the group sums at the step's fixed points. None: one rank.
    tp_size: int = 1
    tp_group: Any = field(default=None, compare=False)

    @property
    def columns(self) -> tuple[ColumnLayout, ...]:
        return tuple(
            ColumnLayout.build(i, self.memory, self.H, self.dk, self.dv, self.f, self.d)
            for i in range(self.n_layers)
        )

    @property
    def in_splits(self) -> tuple[tuple[int, ...], ...]:
        return tuple(c.sizes for c in self.columns)


# ----------------------------------------------------------------------- weights
@dataclass
class LoopWeights:
    """The loop's matrices in (in, out) layout with norm weights folded in."""

    w_in: list[Tensor]
    b_in: list[Tensor]
    w_out: list[Tensor]
    w_fg: Tensor
    b_fg: Tensor
    A: Tensor | None  # exp(A_log): the decay rate per head

    def flat(self) -> list[Tensor]:
        return [
            *self.w_in,
            *self.b_in,
            *self.w_out,
            self.w_fg,
            self.b_fg,
            *([self.A] if self.A is not None else []),
        ]

    @staticmethod
    def unflat(plan: StepPlan, flat: list[Tensor] | tuple[Tensor, ...]) -> LoopWeights:
        L = plan.n_layers
        return LoopWeights(
            list(flat[:L]),
            list(flat[L : 2 * L]),
            list(flat[2 * L : 3 * L]),
            flat[3 * L],
            flat[3 * L + 1],
            flat[3 * L + 2] if plan.memory else None,
        )

    def transposed(self, row_alignment: int = 1) -> LoopWeights:
        """The matrices transposed and contiguous (for the backward's dy @ W^T); the key
        columns of layer 0 come first in its transpose's rows. With `row_alignment` > 1
        each row stride is a multiple of it (`aligned_rows`)."""
        return LoopWeights(
            [aligned_rows(w.t(), row_alignment) for w in self.w_in],
            self.b_in,
            [aligned_rows(w.t(), row_alignment) for w in self.w_out],
            aligned_rows(self.w_fg.t(), row_alignment),
            self.b_fg,
            self.A,
        )

    def untransposed_views(self) -> LoopWeights:
        """Views of transposed copies back in (in, out) layout (no copy)."""
        return LoopWeights(
            [w.t() for w in self.w_in],
            self.b_in,
            [w.t() for w in self.w_out],
            self.w_fg.t(),
            self.b_fg,
            self.A,
        )

    def for_matmul(self, dtype: torch.dtype | None, row_alignment: int = 1) -> LoopWeights:
        """Matrices cast once to the matmul dtype (biases and A stay in the state dtype),
        with row strides a multiple of `row_alignment` elements (`aligned_rows`); the
        same object when neither changes anything."""
        if dtype is None and all(
            w.stride(0) % row_alignment == 0 for w in (*self.w_in, *self.w_out, self.w_fg)
        ):
            return self
        return LoopWeights(
            [aligned_rows(w, row_alignment, dtype) for w in self.w_in],
            self.b_in,
            [aligned_rows(w, row_alignment, dtype) for w in self.w_out],
            aligned_rows(self.w_fg, row_alignment, dtype),
            self.b_fg,
            self.A,
        )


def aligned_rows(w: Tensor, alignment: int, dtype: torch.dtype | None = None) -> Tensor:
    """A copy of the matrix `w` (in `dtype`, default its own) whose rows are contiguous and
    whose row stride is a multiple of `alignment` elements: a view of the first columns of
    a padded buffer where the width is not. The fused input matrix is 27,358 columns wide
    at 130M: unpadded, its bf16 rows start at 2-byte boundaries and a GPU kernel can only
    read them 2 bytes at a time (accounting/gpu_compile.py shows the loads); padded to 16
    elements they are read 16 bytes at a time."""
    rows, cols = w.shape
    padded = -(-cols // alignment) * alignment
    out = w.new_empty((rows, padded), dtype=dtype or w.dtype)[:, :cols]
    out.copy_(w)
    return out


# ------------------------------------------------------------------ forward chunk
@overload
def memory_reads(plan: StepPlan, M0: Tensor) -> Tensor: ...
@overload
def memory_reads(plan: StepPlan, M0: None) -> None: ...
def memory_reads(plan: StepPlan, M0: Tensor | None) -> Tensor | None:
    """The chunk-start memory as the steps (and the backward's recompute) read it: M0
    itself, or under `engine.bf16_memory_reads` a bf16 copy (the carry stays M0). A backend
    handed a bf16 M0 reads its values (`read_values`); the CUDA kernels load it as bf16."""
    if M0 is None or not plan.options.bf16_memory_reads:
        return M0
    return M0.to(torch.bfloat16)


@overload
def read_values(M0: Tensor, like: Tensor) -> Tensor: ...
@overload
def read_values(M0: None, like: Tensor) -> None: ...
def read_values(M0: Tensor | None, like: Tensor) -> Tensor | None:
    """M0 as `memory_reads` gave it, in `like`'s dtype (exact: bf16 widens without rounding)."""
    return M0 if M0 is None or M0.dtype == like.dtype else M0.to(like.dtype)


@dataclass
class ChunkForward:
    """One chunk's forward inputs and output buffers.

    fuse (B, C, d): the grounding input of every step; s, s_prev (B, d) and M0 (B, H, dk, dv)
    the carry entering the chunk (M0 as the steps read it: `memory_reads`); P (B, C, d)
    receives the outputs p_t; S (B, C, d), when given, the state entering every step (what
    the backward recomputes from)."""

    fuse: Tensor
    s: Tensor
    s_prev: Tensor
    M0: Tensor | None
    P: Tensor
    S: Tensor | None = None
    # Written whole by every backend and never read: the engine passes them uninitialised
    # (a graph replay copies them out, not in: ops/gpn_step/graphs.py).
    WRITTEN_WHOLE: ClassVar[tuple[str, ...]] = ("P", "S")


@dataclass
class ChunkForwardResult:
    """The carry leaving the chunk and the chunk's memory history (k_j, u_j and cumulative
    log-decays G_j, (B, H, C, dk | dv | -)), from which the engine advances M once."""

    s: Tensor
    s_prev: Tensor
    K: Tensor | None = None
    U: Tensor | None = None
    G: Tensor | None = None


# ------------------------------------------------------------------ reverse sweep
@dataclass
class ChunkActs:
    """Every activation of a chunk, recomputed in parallel. Dense ones are (C, B, width);
    memory ones (B, H, C, width)."""

    c: list[Tensor]  # input of each layer (c_0 = S)
    n: list[Tensor]  # rms(c_i)
    y: list[Tensor]  # the fused input matmul's output
    hidden: list[Tensor]  # input of the down-projection
    o: list[Tensor | None]  # memory read output (flat, H*dv)
    ro: list[Tensor | None]  # rms(o)
    q: list[Tensor | None]  # read queries (B, H, C, dk)
    rq: list[Tensor | None]  # M0^T q
    n_p: Tensor  # rms(p)
    gate: Tensor  # sigmoid of the fuse gate
    p: Tensor
    s_prev: Tensor | None = None  # (B, d): the chunk's first key comes from it
    n_sprev: Tensor | None = None  # rms(s_prev)
    k_pre: Tensor | None = None  # (C, B, H*dk), row t = the pre-activation of k_t
    k: Tensor | None = None
    v: Tensor | None = None
    beta: Tensor | None = None
    U: Tensor | None = None
    G: Tensor | None = None
    pred: Tensor | None = None  # M_{t-1}^T k_t
    rk: Tensor | None = None  # M0^T k_t
    # On the GPU path under autocast, n and n_p in the matmul dtype (the GEMMs' and the
    # weight gradients' operand, written by the norm: `fused.rms`); else empty / None.
    n_low: list[Tensor] = dataclasses.field(default_factory=list)
    n_p_low: Tensor | None = None
    # Read by the weight gradients only (the down projection's input, the low copies), never
    # by a backend's reverse sweep: a graph replay neither copies them in nor keeps static
    # copies of them (hidden: 344 MB a chunk at 130M and B = 128).
    SWEEP_NEVER_READS: ClassVar[tuple[str, ...]] = ("hidden", "n_low", "n_p_low")
    # Written by the recompute into the engine's two workspaces (`workspace.Workspace`),
    # which stay where they are from chunk to chunk and call to call: a reverse graph binds
    # them by address (graphs.py), so a replay copies none of them in. (`v` is a view of `y`;
    # `s_prev` is the forward's carry, copied.)
    BOUND: ClassVar[tuple[str, ...]] = (
        *("c", "n", "y", "o", "ro", "q", "rq", "n_p", "gate", "p"),
        *("n_sprev", "k_pre", "k", "v", "beta", "U", "G", "pred", "rk"),
    )

    def tensors(self) -> list[Tensor]:
        """Every tensor held (the overlapped backward hands them from stream to stream)."""
        found: list[Tensor] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            found.extend(
                t for t in (value if isinstance(value, list) else [value]) if t is not None
            )
        return found

    def memory(self) -> MemoryActs:
        """The memory activations, none of them None: GPN+M only (under `plan.memory`)."""
        assert self.s_prev is not None and self.n_sprev is not None and self.k_pre is not None
        assert self.k is not None and self.v is not None and self.beta is not None
        assert self.U is not None and self.G is not None
        assert self.pred is not None and self.rk is not None
        # Every layer of GPN+M reads the memory: the per-layer lists hold tensors only.
        return MemoryActs(
            self.s_prev,
            self.n_sprev,
            self.k_pre,
            self.k,
            self.v,
            self.beta,
            self.U,
            self.G,
            self.pred,
            self.rk,
            cast("list[Tensor]", self.q),
            cast("list[Tensor]", self.rq),
            cast("list[Tensor]", self.o),
            cast("list[Tensor]", self.ro),
        )


class MemoryActs(NamedTuple):
    """`ChunkActs`' memory activations of a GPN+M chunk, as present tensors (the same
    objects; `ChunkActs.memory()`)."""

    s_prev: Tensor
    n_sprev: Tensor
    k_pre: Tensor
    k: Tensor
    v: Tensor
    beta: Tensor
    U: Tensor
    G: Tensor
    pred: Tensor
    rk: Tensor
    q: list[Tensor]
    rq: list[Tensor]
    o: list[Tensor]
    ro: list[Tensor]


@dataclass
class SweepAdjoints:
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
    # Written whole at every step by every backend, their content on entry never read: the
    # engine takes them uninitialised from its workspace (chunk._sweep_adjoints) and a graph
    # replay does not copy them in. The memory adjoints dK, dU, dG, dA accumulate.
    WRITTEN_WHOLE: ClassVar[tuple[str, ...]] = ("dY", "dZ", "dYfg", "d_fuse", "dRk", "dRq")
    # The engine's adjoint workspaces (workspace.workspaces: two sets, alternating by chunk,
    # kept from call to call): a graph binds them by address, no copy in or out. (d_fuse is
    # a view of the window's whole d_fuse; dA is made per chunk: copied.)
    BOUND: ClassVar[tuple[str, ...]] = ("dY", "dZ", "dYfg", "dK", "dU", "dG", "dRk", "dRq")

    def memory(self) -> MemoryAdjoints:
        """The memory adjoints, none of them None: GPN+M only (under `plan.memory`)."""
        assert self.dK is not None and self.dU is not None and self.dG is not None
        assert self.dRk is not None and self.dA is not None
        return MemoryAdjoints(self.dK, self.dU, self.dG, self.dRk, self.dA)


class MemoryAdjoints(NamedTuple):
    """`SweepAdjoints`' memory adjoints of a GPN+M chunk, as present tensors (the same
    objects; `SweepAdjoints.memory()`)."""

    dK: Tensor
    dU: Tensor
    dG: Tensor
    dRk: Tensor
    dA: Tensor


@dataclass
class ReverseSweep:
    """One chunk's reverse-sweep inputs: its activations, its start memory M0 as the steps
    read it (`memory_reads`), the gradient of its outputs dP (B, C, d), of the carry leaving
    it (ds_end, ds_prev_end: (B, d) or None), and the adjoint buffers the sweep adds to."""

    acts: ChunkActs
    M0: Tensor | None
    dP: Tensor
    ds_end: Tensor | None
    ds_prev_end: Tensor | None
    adjoints: SweepAdjoints


@dataclass
class ReverseSweepResult:
    """The gradient of the state entering the chunk (B, d), and that of the pre-activation
    of the chunk's first key (B, H*dk; GPN+M only), which came from s_prev."""

    ds_start: Tensor
    dk_pre0: Tensor | None


# ------------------------------------------------------------------------ backend
class StepBackend(Protocol):
    """What the engine calls for the sequential parts of a chunk."""

    name: str
    # The loop matrices' row strides this backend wants a multiple of (elements): the
    # engine pads its matmul copies of them to it (`LoopWeights.for_matmul`).
    row_alignment: int
    # The `SweepAdjoints` fields this backend writes in the plan's matmul dtype (bf16 under
    # autocast), where only matmuls read them (which cast them to it anyway): same values.
    matmul_only_adjoints: tuple[str, ...]

    def forward_chunk(
        self, plan: StepPlan, W: LoopWeights, chunk: ChunkForward
    ) -> ChunkForwardResult: ...

    def reverse_sweep(
        self, plan: StepPlan, Wt: LoopWeights, sweep: ReverseSweep
    ) -> ReverseSweepResult:
        """Wt: the loop weights transposed (`LoopWeights.transposed`)."""
        ...
