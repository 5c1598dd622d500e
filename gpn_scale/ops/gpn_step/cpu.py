"""The fused C++ step kernels (`csrc/step_kernels.cpp`, built by `step_kernels.py` beside
this file) as a step backend: a whole chunk's steps in one call, the matmuls through ATen and
everything else as plain loops over batch rows. CPU tensors only."""

from __future__ import annotations

from types import ModuleType

from gpn_scale.ops.gpn_step.interface import (
    ChunkForward,
    ChunkForwardResult,
    LoopWeights,
    ReverseSweep,
    ReverseSweepResult,
    StepPlan,
    read_values,
)


class CpuBackend:
    name = "cpu"
    row_alignment = 1
    matmul_only_adjoints: tuple[str, ...] = ()

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def forward_chunk(
        self, plan: StepPlan, W: LoopWeights, chunk: ChunkForward
    ) -> ChunkForwardResult:
        out = self.module.chunk_forward(
            plan.n_layers,
            plan.memory,
            plan.H,
            plan.dk,
            plan.dv,
            plan.f,
            plan.eps,
            W.w_in,
            W.b_in,
            W.w_out,
            W.w_fg,
            W.b_fg,
            W.A,
            chunk.fuse,
            chunk.s,
            chunk.s_prev,
            read_values(chunk.M0, chunk.s),
            chunk.P,
            chunk.S,
        )
        if not plan.memory:
            return ChunkForwardResult(out[0], out[1])
        return ChunkForwardResult(*out)

    def reverse_sweep(
        self, plan: StepPlan, Wt: LoopWeights, sweep: ReverseSweep
    ) -> ReverseSweepResult:
        acts, a, mem = sweep.acts, sweep.adjoints, plan.memory
        mem_acts = (
            [acts.k_pre, acts.k, acts.v, acts.beta, acts.U, acts.G, acts.pred, acts.rk]
            + [read_values(sweep.M0, sweep.dP)]
            if mem
            else []
        )
        ds, dk_pre0 = self.module.chunk_backward(
            plan.n_layers,
            mem,
            plan.H,
            plan.dk,
            plan.dv,
            plan.f,
            plan.eps,
            Wt.w_in,
            Wt.w_out,
            Wt.w_fg,
            Wt.A,
            acts.c,
            acts.n,
            acts.y,
            acts.o if mem else [],
            acts.ro if mem else [],
            acts.q if mem else [],
            acts.rq if mem else [],
            acts.n_p,
            acts.gate,
            acts.p,
            mem_acts,
            sweep.dP,
            sweep.ds_end,
            sweep.ds_prev_end,
            a.dY,
            a.dZ,
            a.dRq,
            a.dYfg,
            a.d_fuse,
            [a.dK, a.dU, a.dG, a.dRk, a.dA] if mem else [],
        )
        return ReverseSweepResult(ds, dk_pre0)
