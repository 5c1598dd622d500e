"""The same accounting for what users would otherwise train: a Transformer++ step.

    python -m gpn_scale.accounting.gpu_model gpn_m_130m --batch 64     # prints both side by side

The family's own model (`models/transformer_pp`) runs one training step (forward, loss,
backward) on meta tensors as the device check trains it (`bench/gpu_throughput.measure`):
float32 parameters under bf16 autocast, on the CUDA code path. Every ATen op that launches a
kernel is recorded with its operands' bytes and matmul FLOPs (the dispatch recorder of
`kernel_record.py`), and every Triton launch of ours (the head loss's softmax cross-entropy)
where it runs among them. Two stand-ins make meta tensors run what a GPU runs:

- **autocast** (`autocast_emulated`): autocast knows no meta device, so the casts CUDA's
  autocast makes are made here: the operands of every matmul go to bf16 (a parameter once a
  forward, as autocast caches it), and the rest run in the dtypes type promotion gives them.
  That is the whole of CUDA autocast's effect on this model: its float32-list ops (norms,
  softmax, pow, rsqrt, sums) only ever see float32 here, the residual stream being the
  float32 embedding's (a test holds the dtypes of every op equal to a real autocast run's on
  CPU). The head loss takes its matmul dtype from `execution(matmul_dtype=bf16)`, which
  `linear_cross_entropy` reads where autocast does not know the device;
- **attention** is what a GPU runs for `F.scaled_dot_product_attention` in bf16, flash
  attention, not the math form meta tensors would decompose it into: a stand-in casts q, k
  and v to bf16 (as autocast does) and records one forward and one backward kernel per layer
  with flash attention's FLOPs (causal: half the T x T scores) and its bytes (q, k, v, o, the
  row statistics; the backward also dO, dq, dk, dv), priced at `EFF_ATTENTION` of the dense
  peak.

Each op is then priced like the GPN's chunk-wide ATen work: max(bytes / bandwidth, FLOPs /
peak) plus the gap between kernels, at least the host's launch cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from gpn_scale.accounting.kernel_record import AtenRecorder, Op
from gpn_scale.ops import launch as launches_
from gpn_scale.ops.execution import execution

# FlashAttention-2 (what torch's SDPA runs in bf16 on H100/H200) reaches ~35-40% of the
# dense bf16 peak for causal attention at head dim 64-128, forward and backward alike
# (FlashAttention-2 and -3 papers' H100 figures); FlashAttention-3 ~60%.
EFF_ATTENTION = 0.35


class _Recorded:
    ops: list | None = None
    autocast: torch.dtype | None = None  # the dtype attention's operands go to (autocast's)


class _FlashAttentionStandIn(torch.autograd.Function):
    """Records flash attention's forward and backward kernels; returns empty tensors."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        B, H, T, dh = q.shape
        flops = 2 * 2 * B * H * T * T * dh // 2  # QK^T and PV, causal half
        lse = B * H * T * 4
        _record("flash attention forward", 4 * q.numel() * q.element_size() + lse, flops)
        ctx.meta = (q.shape, q.dtype, q.device, flops, lse, q.numel() * q.element_size())
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout: Tensor):
        shape, dtype, device, flops, lse, size = ctx.meta
        # q, k, v, o, dO read, dq, dk, dv written; 2.5x the forward's FLOPs (the scores are
        # recomputed, then dV, dP, dS, dQ, dK).
        _record("flash attention backward", 8 * size + lse, int(2.5 * flops))
        return tuple(torch.empty(shape, dtype=dtype, device=device) for _ in range(3))


def _record(name: str, nbytes: int, flops: int) -> None:
    # into the dispatch recorder's list, in the order the step runs them
    if _Recorded.ops is not None:
        _Recorded.ops.append(Op(name, "attention", nbytes, flops, False, efficiency=EFF_ATTENTION))


@contextlib.contextmanager
def _flash_attention(ops: list) -> Iterator[None]:
    real = F.scaled_dot_product_attention

    def stand_in(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        assert is_causal and attn_mask is None, "the training step's attention is causal"
        if _Recorded.autocast is not None:  # autocast runs attention in its dtype
            q, k, v = (x.to(_Recorded.autocast) for x in (q, k, v))
        return _FlashAttentionStandIn.apply(q, k, v)

    _Recorded.ops = ops
    setattr(F, "scaled_dot_product_attention", stand_in)  # noqa: B010  (mypy: not its type)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = real
        _Recorded.ops = None


# The torch functions CUDA autocast runs in its lower-precision dtype, as this model calls
# them (nn.Linear's F.linear, the head loss's `@`, attention, and their other forms).
_AUTOCAST_MATMULS = {
    F.linear,
    F.scaled_dot_product_attention,
    torch.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch.baddbmm,
    Tensor.matmul,
    Tensor.__matmul__,
    Tensor.mm,
    Tensor.bmm,
}


class _AutocastOnMeta(TorchFunctionMode):
    """CUDA autocast's casts, on tensors autocast does not know (meta): a matmul's floating
    operands go to `dtype`; a parameter (a leaf that requires grad) is cast once while the
    mode is on, as autocast caches it. Above autograd, as autocast is, so the backward has
    the casts' own backward (the gradient cast back to float32)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self._cast_parameters: dict[int, tuple[Tensor, Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _AUTOCAST_MATMULS and "out" not in kwargs:  # autocast leaves out= forms be
            args = tuple(self._cast(a) for a in args)
            kwargs = {key: self._cast(a) for key, a in kwargs.items()}
        return func(*args, **kwargs)

    def _cast(self, t: Any) -> Any:
        if not isinstance(t, Tensor) or not t.is_floating_point() or t.dtype == self.dtype:
            return t
        if not (t.is_leaf and t.requires_grad):
            return t.to(self.dtype)
        # keyed by identity, the parameter kept beside its cast so that the id stays its own
        hit = self._cast_parameters.get(id(t))
        if hit is None or hit[0] is not t:
            hit = (t, t.to(self.dtype))
            self._cast_parameters[id(t)] = hit
        return hit[1]


@contextlib.contextmanager
def autocast_emulated(dtype: torch.dtype) -> Iterator[None]:
    """The forward of a baseline model within it runs as under CUDA autocast to `dtype`, on
    any device (meta included): its matmuls' casts (`_AutocastOnMeta`), attention's through
    the flash stand-in, and the head loss's matmul dtype (`execution(matmul_dtype=...)`)."""
    _Recorded.autocast = dtype
    try:
        with execution(matmul_dtype=dtype), _AutocastOnMeta(dtype):
            yield
    finally:
        _Recorded.autocast = None


class _LaunchesAmongOps(list):
    """The dry run's launch record (ops/launch.py appends each Triton launch to it): each
    launch also goes into the recorder's ops where it runs, between the ATen ops."""

    def __init__(self, ops: list[Op]) -> None:
        super().__init__()
        self._ops = ops

    def append(self, launch: launches_.Launch) -> None:
        super().append(launch)
        self._ops.append(Op(launch.name, launch.phase, launch.bytes, launch.flops, True))


_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}


def fused(ops: list[Op]) -> list[Op]:
    """The step as `torch.compile` runs it (compile.enable): the matmuls, flash attention and
    our Triton kernels as they are, and each run of pointwise and reduction ops between two of
    them as ONE kernel (inductor fuses them), which moves at least the largest operand set of
    the run once: that op's bytes. A lower bound on what inductor's kernels move; the matmuls,
    attention and our kernels are the eager step's own."""
    out: list[Op] = []
    run: list[Op] = []

    def flush() -> None:
        if run:
            big = max(run, key=lambda op: op.bytes)
            out.append(Op(f"fused pointwise ({len(run)} ops)", big.phase, big.bytes, 0, False))
            run.clear()

    for op in ops:
        if op.name.rstrip("_") in _MATMULS or op.phase == "attention" or op.triton:
            flush()
            out.append(op)
        else:
            run.append(op)
    flush()
    return out


def matched_transformer(like: Any) -> Any:
    """The Transformer++ the device check trains beside the GPN `like` (a GPNConfig;
    bench/gpu_throughput.transformer_candidate): its embedding width and about its parameter
    count, tied embedding and head (`transformer_pp.counts.matching_config`), named as the
    device check names its rows."""
    from gpn_scale.models.gpn.counts import count_parameters
    from gpn_scale.models.transformer_pp import counts

    cfg = counts.matching_config(like.vocab_size, like.d_emb, count_parameters(like))
    return cfg.replace(name=f"transformer++ L{cfg.n_layers} d{cfg.d_model} f{cfg.d_ffn}")


def transformer_step_ops(cfg, batch: int, seq_len: int, compiled: bool = False) -> list:
    """Every kernel of one Transformer++ training step at (batch, seq_len) as the device check
    trains it (float32 parameters, bf16 autocast, the CUDA code path); with `compiled`, its
    pointwise runs fused as torch.compile fuses them (`fused`)."""
    from gpn_scale.models.registry import family_of

    spec = family_of(cfg)
    with torch.device("meta"):
        model = spec.build(cfg)
    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    recorder = AtenRecorder(sequential=True)
    bf16 = torch.bfloat16
    with (
        execution(launches=_LaunchesAmongOps(recorder.ops), dry=True),
        _flash_attention(recorder.ops),
        recorder,
    ):
        with autocast_emulated(bf16):
            loss = model(tokens).loss
        loss.backward()
    ops = recorder.ops
    return fused(ops) if compiled else ops
