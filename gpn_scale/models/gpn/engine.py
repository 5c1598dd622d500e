"""The sequence engine: GPN / GPN+M over a window, fast and exact.

Layout of one forward (see `shared/spec/gpn-model.md` for the equations):

1. Outside the time loop, over all B*T positions at once: embedding and fuse projection.
2. The time loop: the sequence op `ops.gpn_step.chunk.gpn_sequence` (chunk by chunk, on a
   step backend chosen by device and the engine options' `step_backend`; its forward and the
   hand-written backward are described there). What it needs from the model is made here:
   - every projection of one input is ONE matmul: the grounded state s feeds the memory
     write (k for the next step, v, beta, decay) and layer 0's read query, read gate,
     FFN and predict gate; RMSNorm weights are folded into those matrices
     (rms(x; w) @ W == (x / rms(x)) @ (diag(w) W)); the read output and FFN share one
     down-projection matmul (`fold_loop_weights`, differentiable: the op's weight
     gradients flow back through the folding to the parameters);
   - the plan: the widths (this rank's share under tp), the chunk spans (every
     `chunk_size` steps and at every truncated-BPTT cut), the matmul dtype, and the
     engine options (`config.engine`, ops/gpn_step/options.py: the backend, CUDA graphs).
3. Decode and cross-entropy in blocks of positions (`models/gpn/loss.py`), never the full
   B x T x V logits, fed each stretch of chunks' outputs as the loop makes them (on CUDA on
   a second stream, beside the next chunk's steps: `engine.overlap_decode`).

Under tensor parallelism the embedding / tied output E is vocabulary-parallel
(`models/gpn/vocab_parallel.py`): the lookup is summed over the tp group and the loss's logits
are this rank's V/tp columns only.

Under torch.autocast the large matmuls run in the autocast dtype; the state, the memory
and every elementwise recurrence op stay in float32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from gpn_scale.models.gpn.config import GPNConfig
from gpn_scale.models.gpn.loss import ChunkFeed, DecodePass, decode_cross_entropy, needs_grad
from gpn_scale.models.gpn.modules import Gate, MemoryWrite, PredictorLayer
from gpn_scale.models.gpn.state import GPNOutput, GPNState
from gpn_scale.models.gpn.vocab_parallel import embed, gather_vocab
from gpn_scale.ops.execution import autocast_dtype
from gpn_scale.ops.gpn_step.chunk import gpn_sequence, make_spans
from gpn_scale.ops.gpn_step.collectives import sum_grad_over_tp
from gpn_scale.ops.gpn_step.functional import rms as _rms
from gpn_scale.ops.gpn_step.interface import ColumnLayout, LoopWeights, StepPlan
from gpn_scale.ops.gpn_step.overlap import side_work
from gpn_scale.ops.gpn_step.phases import phase


class EngineModel(Protocol):
    """What the engine reads of the model that calls it (gpn.py's GPN, which imports the
    engine; the engine imports only this description of it): the config, the parameters by
    their submodules (modules.py's blocks), and the carry's dtype and initial value."""

    @property
    def config(self) -> GPNConfig: ...
    @property
    def embedding(self) -> nn.Embedding: ...
    @property
    def fuse_norm_weight(self) -> Tensor: ...
    @property
    def fuse(self) -> nn.Linear: ...
    @property
    def fuse_gate(self) -> Gate: ...
    @property
    def write(self) -> MemoryWrite | None: ...
    @property
    def predictor_layers(self) -> Iterable[PredictorLayer]: ...
    @property
    def decode_norm_weight(self) -> Tensor: ...
    @property
    def decode(self) -> nn.Linear: ...
    def state_dtype(self) -> torch.dtype: ...
    def initial_state(
        self, batch_size: int, device: torch.device | str | None = None
    ) -> GPNState: ...


# ----------------------------------------------------------------------------- plan
def input_column_blocks(cfg: GPNConfig, layer: int) -> tuple[int, ...]:
    """Column blocks of layer `layer`'s fused input matmul, in order (`ColumnLayout`)."""
    return ColumnLayout.build(
        layer, cfg.memory, cfg.n_heads, cfg.d_key, cfg.d_value, cfg.d_ffn, cfg.d_state
    ).sizes


# --------------------------------------------------------------------- weights
def local(p: Tensor) -> Tensor:
    """This rank's share of a parameter: the local tensor of a DTensor (tensor parallelism
    applied by `models/gpn/parallelize.py`; differentiable, its gradient returns as a DTensor of
    the same placement), the tensor itself otherwise."""
    return p.to_local() if isinstance(p, DTensor) else p


def tp_group_of(model: EngineModel) -> tuple[object | None, int]:
    """(process group, size) of the tp mesh the parameters live on; (None, 1) without TP.

    The model holds no process group: its tp plan (`parallelize.py`) makes every parameter a
    DTensor on the 1-D tp mesh (FSDP2's unsharded parameters in the forward are DTensors on it
    too)."""
    p = model.fuse.weight
    if isinstance(p, DTensor) and p.device_mesh.size() > 1:
        return p.device_mesh.get_group(), p.device_mesh.size()
    return None, 1


def fold_loop_weights(model: EngineModel, tp_group: object | None = None) -> LoopWeights:
    """Build the loop's fused matrices from the module's parameters (differentiable).

    Under tensor parallelism each block is this rank's share (its heads, its FFN columns of
    both halves of W_1, its rows of W_o and W_2); the predict and fuse gates are whole. The
    norm weights folded into sharded blocks are replicated: their gradient is summed over
    `tp_group` (each rank holds its columns' share)."""
    shared = lambda p: sum_grad_over_tp(local(p), tp_group)  # noqa: E731
    w_in, b_in, w_out = [], [], []
    for i, layer in enumerate(model.predictor_layers):
        cols: list[Tensor] = []
        biases: list[Tensor] = []
        if i == 0 and model.write is not None:
            wr = model.write
            nw = shared(wr.norm_weight)[:, None]
            key_b = local(wr.key.bias)
            value_w, beta_w = local(wr.value.weight), local(wr.beta.weight)
            cols += [
                nw * local(wr.key.weight).t(),
                nw * value_w.t(),
                nw * beta_w.t(),
                nw * local(wr.decay.weight).t(),
            ]
            biases += [
                key_b,
                key_b.new_zeros(value_w.shape[0]),
                key_b.new_zeros(beta_w.shape[0]),
                local(wr.dt_bias),
            ]
        if layer.read is not None:
            rd = layer.read
            nr = shared(rd.norm_weight)[:, None]
            gate_w = local(rd.gate.weight)
            q_b = local(rd.query.bias)
            cols += [nr * local(rd.query.weight).t(), nr * gate_w.t()]
            biases += [q_b, q_b.new_zeros(gate_w.shape[0])]
        w1 = local(layer.ffn.w1.weight).flatten(0, 1)
        pg_b = local(layer.gate.proj.bias)
        cols += [
            shared(layer.ffn.norm_weight)[:, None] * w1.t(),
            local(layer.gate.norm_weight)[:, None] * local(layer.gate.proj.weight).t(),
        ]
        biases += [pg_b.new_zeros(w1.shape[0]), pg_b]
        w_in.append(torch.cat(cols, dim=1))
        b_in.append(torch.cat(biases))
        outs = []
        if layer.read is not None:
            outs.append(
                local(layer.read.out_norm_weight)[:, None] * local(layer.read.out.weight).t()
            )
        outs.append(local(layer.ffn.w2.weight).t())
        w_out.append(torch.cat(outs, dim=0))
    fg = model.fuse_gate
    A = torch.exp(local(model.write.A_log)) if model.write is not None else None
    return LoopWeights(
        w_in,
        b_in,
        w_out,
        local(fg.norm_weight)[:, None] * local(fg.proj.weight).t(),
        local(fg.proj.bias),
        A,
    )


# ------------------------------------------------------------------ entry point
def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, mm_dtype: torch.dtype | None) -> Tensor:
    """F.linear in the matmul dtype (if any), result back in x's dtype."""
    if mm_dtype is None:
        return F.linear(x, weight, bias)
    y = F.linear(x.to(mm_dtype), weight.to(mm_dtype)).to(x.dtype)
    return y if bias is None else y + bias


def _step_plan(
    cfg: GPNConfig, T: int, tp_size: int, tp_group: Any, mm_dtype: torch.dtype | None
) -> StepPlan:
    """The sequence op's plan for T tokens: this rank's share of the heads and FFN columns,
    the chunk spans and the tbptt cuts."""
    spans, cuts = make_spans(T, cfg.engine.chunk_size, cfg.tbptt)
    return StepPlan(
        n_layers=cfg.n_layers,
        memory=cfg.memory,
        H=cfg.n_heads // tp_size,
        dk=cfg.d_key,
        dv=cfg.d_value,
        d=cfg.d_state,
        f=cfg.d_ffn // tp_size,
        eps=cfg.norm_eps,
        spans=spans,
        cuts=cuts,
        mm_dtype=mm_dtype,
        options=cfg.engine,
        tp_size=tp_size,
        tp_group=tp_group,
    )


def run_engine(
    model: EngineModel,
    tokens: Tensor,
    state: GPNState | None,
    *,
    return_state: bool = False,
    return_logits: bool = False,
) -> GPNOutput:
    """The model's forward: see the module docstring."""
    cfg = model.config
    if tokens.dim() != 2:
        raise ValueError(f"tokens: expected shape (batch, time), got {tuple(tokens.shape)}")
    B, T = tokens.shape
    device = tokens.device
    mm_dtype = autocast_dtype(device.type)  # the accounting's meta tensors: execution's
    with (
        torch.autocast(device.type, enabled=False)
        if device.type != "meta"
        else contextlib.nullcontext()
    ):
        tp_group, tp_size = tp_group_of(model)
        # Under tensor parallelism the memory carried is this rank's heads (B, H/tp, dk, dv).
        H_local = cfg.n_heads // tp_size
        if state is None:
            state = model.initial_state(B, device)
            if tp_size > 1 and state.memory is not None:
                state = GPNState(state.s, state.s_prev, state.memory[:, :H_local].clone())
        sdt = model.state_dtype()
        eps = cfg.norm_eps
        E = local(model.embedding.weight)  # under tp: this rank's V/tp rows
        emb = embed(tokens, E, tp_group)
        fuse = _linear(
            _rms(emb.to(sdt), eps) * local(model.fuse_norm_weight),
            local(model.fuse.weight),
            None,
            mm_dtype,
        )
        plan = _step_plan(cfg, T, tp_size, tp_group, mm_dtype)
        weights = fold_loop_weights(model, tp_group)
        carry = (
            state.s.to(sdt),
            state.s_prev.to(sdt),
            None if state.memory is None else state.memory.to(sdt),
        )
        dec_w, bias = local(model.decode.weight), model.decode.bias
        dec_b = None if bias is None else local(bias)
        dec_norm = local(model.decode_norm_weight)
        decode = DecodePass(
            dec_norm,
            dec_w,
            dec_b,
            E,
            cfg.engine.loss_chunk_tokens,
            eps,
            mm_dtype,
            needs_grad(fuse, *carry, *weights.flat(), dec_norm, dec_w, dec_b, E),
            tp_group,
            fuse.dtype,
        )
        # Each chunk's decode and loss beside the next chunk's steps (not under tp: the
        # vocabulary-parallel loss's collectives would race the steps' on a second stream).
        side = side_work(device, cfg.engine.overlap_decode and tp_group is None)
        feed = ChunkFeed(decode, tokens, side)
        P, (s, s_prev, M) = gpn_sequence(plan, fuse, carry, weights, on_chunk=feed)
        with phase("decode", device):
            loss = decode_cross_entropy(
                P, dec_norm, dec_w, dec_b, E, feed.finish, scale=1.0 / (B * T)
            )
        logits = None
        if return_logits:  # tests, evaluation, generation: the full (B, T, V) block
            h = _linear(_rms(P, eps) * dec_norm, dec_w, dec_b, mm_dtype)
            # Under tp every rank gathers the group's vocabulary shards (the slow path).
            logits = gather_vocab(_linear(h, E, None, mm_dtype), tp_group)
    final = GPNState(s, s_prev, M) if return_state else None
    return GPNOutput(loss=loss, state=final, logits=logits)
