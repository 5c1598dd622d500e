"""What the compile gate compiles (accounting/gpu_compile.py): the targets (a CUDA
architecture and the per-SM resources occupancy is computed from), the cases (a training
step of a model config at a batch, dtype and tp rank; the gate's set and the widest shapes)
and every kernel launch of one case's step, recorded on meta tensors."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch


# ------------------------------------------------------------------------------ targets
@dataclass(frozen=True)
class Target:
    """A CUDA architecture and the per-SM resources occupancy is computed from."""

    name: str
    arch: int  # compute capability x 10
    gpu: str  # the GPU the SM count is of
    sm_count: int
    smem_per_block: int  # bytes a block may use (opt-in maximum)
    smem_per_sm: int
    regs_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    smem_reserved_per_block: int = 1024

    def blocks_per_sm(self, registers: int, num_warps: int, shared: int) -> int:
        """Resident blocks per SM: registers are allocated per warp in units of 256 (per
        thread rounded to 8), shared memory per block plus the driver's 1 KB reserve."""
        regs = -(-max(registers, 1) // 8) * 8
        per_warp = -(-regs * 32 // 256) * 256
        by_regs = self.regs_per_sm // (per_warp * num_warps)
        by_smem = self.smem_per_sm // (shared + self.smem_reserved_per_block)
        by_warps = self.max_warps_per_sm // num_warps
        return max(0, min(by_regs, by_smem, by_warps, self.max_blocks_per_sm))


TARGETS = {
    "sm_90": Target("sm_90", 90, "H100/H200", 132, 232448, 233472),
    "sm_80": Target("sm_80", 80, "A100", 108, 166912, 167936),
}


# ------------------------------------------------------------------------------ cases
@dataclass(frozen=True)
class Case:
    """One training step whose launches are compiled: a model config (a name from
    configs/model, or "testing_tiny" for the tests' tiny config), its overrides, the
    batch, the matmul dtype and one rank of a tp group of `tp`."""

    config: str
    batch: int
    dtype: str = "bf16"  # "bf16" (autocast: bf16 operands, fp32 state) | "fp32" | "fp64"
    tp: int = 1
    seq_len: int = 0  # 0: two chunks
    overrides: tuple[tuple[str, Any], ...] = ()
    # A shipped paper config: the gate also holds its step GEMMs to one wave of programs and
    # to 16-byte loads of the weights.
    shipped: bool = False

    @property
    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.overrides)
        tp = f" tp={self.tp}" if self.tp > 1 else ""
        return f"{self.config}{extra}{tp} {self.dtype} B={self.batch}"


GATE_CASES = (
    Case("gpn_m_130m", 16, shipped=True),
    Case("gpn_m_130m", 64, shipped=True),
    Case("gpn_m_130m", 128, shipped=True),  # the GEMMs' 128-row tiles (8 warps)
    # engine.bf16_memory_reads (off by default): the memory kernels' bf16 M0 variants
    Case("gpn_m_130m", 128, overrides=(("bf16_memory_reads", True),)),
    Case("gpn_m_130m_2l", 16, shipped=True),
    Case("gpn_m_130m_2l", 64, shipped=True),
    # engine.cublas_gemms (off by default): the reduce kernel applying each step GEMM's scale
    # and epilogue after cuBLAS's product (two layers: the low copies and the read norm's K split)
    Case("gpn_m_130m_2l", 128, overrides=(("cublas_gemms", "all"),)),
    Case("gpn_m_1b", 16, tp=8),
    Case("testing_tiny", 3, dtype="fp32"),
    Case("testing_tiny", 3, dtype="fp64", overrides=(("n_layers", 2),)),
    Case("testing_tiny", 3, dtype="fp32", overrides=(("memory", False),)),
)


# The largest shapes a sweep may give one GPU (the offsets check records their launches,
# compiles nothing): a (B, T, d)-strided view then spans more than 2**31 elements.
WIDE_CASES = (
    Case("gpn_m_130m", 8192),
    Case("gpn_m_1b", 4096, tp=8),
)


def model_config(case: Case):
    from gpn_scale.models.gpn import load_model_config

    overrides = dict(case.overrides)
    if case.config == "testing_tiny":
        from gpn_scale.testing.models import tiny_config

        return tiny_config(step_backend="cuda", **overrides)
    return load_model_config(case.config, {"step_backend": "cuda", **overrides})


def plain_twin(rec: Any) -> Any:
    """A launch of a memory kernel that leaves SMs to a side stream (RESERVED_SMS > 0)
    as its plain grid (None for any other launch): the accounting prices its items as that
    grid's programs (kernel_costs), and the gate compiles both."""
    if rec.kernel is None or not rec.meta.get("RESERVED_SMS", 0):
        return None
    return dataclasses.replace(rec, meta={**rec.meta, "RESERVED_SMS": 0, "EMULATED_SMS": 0})


def record_launches(case: Case, sm_count: int | None = None, arch: int | None = None) -> list:
    """Every kernel launch of one training step of `case` (meta tensors, nothing runs), with
    its kernel, arguments and meta-parameters; the GEMM grids sized for a GPU of
    `sm_count` SMs and architecture `arch` (compute capability x 10; default: the CUDA
    backend's dry-run assumption, an H100/H200)."""
    from gpn_scale.accounting.dry_run import as_tp_rank
    from gpn_scale.models.gpn import GPN
    from gpn_scale.models.gpn.parallelize import check_tp
    from gpn_scale.ops import launch
    from gpn_scale.ops.execution import execution
    from gpn_scale.ops.gpn_step.registry import ENV_VAR
    from gpn_scale.ops.gpn_step.workspace import release_workspaces

    release_workspaces()  # each case records as a fresh process would
    cfg = model_config(case)
    check_tp(cfg, case.tp, "tp")
    if case.tp > 1:
        cfg = cfg.replace(n_heads=cfg.n_heads // case.tp, d_ffn=cfg.d_ffn // case.tp)
    with torch.device("meta"):
        model = GPN(cfg)
    if case.dtype == "fp64":
        model = model.to(torch.float64)
    T = case.seq_len or 2 * cfg.engine.chunk_size
    tokens = torch.zeros(case.batch, T, dtype=torch.long, device="meta")
    settings = execution(
        matmul_dtype=torch.bfloat16 if case.dtype == "bf16" else None,
        assumed_sms=sm_count or None,
        assumed_arch=arch,
    )
    previous = os.environ.pop(ENV_VAR, None)
    try:
        with (
            launch.recording(dry=True, keep_args=True) as launches,
            settings,
            as_tp_rank(case.tp),
        ):
            model(tokens).loss.backward()
    finally:
        if previous is not None:
            os.environ[ENV_VAR] = previous
    return list(launches)
