"""`ops/gpn_step/gemm.gemm_plan`: how a few-row step GEMM is tiled and split over K on a GPU
of a given size (pure arithmetic; the compile gate checks the same grids compiled)."""

from __future__ import annotations

import pytest
import torch

from gpn_scale.ops.execution import execution
from gpn_scale.ops.gpn_step import gemm, geometry


@pytest.fixture
def on_gpu_sizes(monkeypatch):
    monkeypatch.setattr(geometry, "interpreting", lambda t: False)


# (M, N, K, k1): the 130M step GEMMs (d = 2496, width 27,358, the down GEMM's read columns
# 3,840 then the FFN's) and a 1B tp rank's, at B = 16 / 64 / 128.
SHAPES = [
    (m, n, k, k1)
    for m in (16, 64, 128)
    for n, k, k1 in (
        (2496, 27358, 0),
        (2496, 2496, 0),
        (2496, 3840 + 6656, 3840),
        (27358, 2496, 0),
        (512, 2048, 0),  # a narrow tp rank's: 4 tiles x at most MAX_SPLITS
    )
]


@pytest.mark.parametrize("sms", [132, 108])
@pytest.mark.parametrize("shape", SHAPES)
def test_split_grids_fill_their_waves_and_never_straddle_the_read_columns(
    on_gpu_sizes, shape, sms, monkeypatch
):
    M, N, K, k1 = shape
    monkeypatch.setattr(geometry, "sm_count", lambda t: sms)
    t = torch.empty(0, device="meta")
    plan = gemm.gemm_plan(M, N, K, t, k1)
    grid = plan.grid(M, N)
    programs = grid[0] * grid[1] * (grid[2] if len(grid) > 2 else 1)
    if plan.splits == 1:
        assert grid[0] * grid[1] >= sms or K <= plan.block_k
        return
    assert plan.splits <= gemm.MAX_SPLITS + (1 if k1 else 0)
    capped = plan.splits >= gemm.MAX_SPLITS  # as many as allowed: too few tiles to fill a wave
    assert capped or gemm.wave_fill(programs, sms) >= 0.75, (plan, programs)
    assert plan.k_per_split % plan.block_k == 0
    # The ranges cover [0, K) once; the first splits_k1 end at k1 or inside it.
    ranges = [
        (s * plan.k_per_split, min((s + 1) * plan.k_per_split, k1)) for s in range(plan.splits_k1)
    ] + [
        (k1 + s * plan.k_per_split, min(k1 + (s + 1) * plan.k_per_split, K))
        for s in range(plan.splits - plan.splits_k1)
    ]
    assert all(lo < hi for lo, hi in ranges)
    assert sum(hi - lo for lo, hi in ranges) == K


def test_a_split_never_leaves_a_nearly_empty_second_wave(on_gpu_sizes, monkeypatch):
    """Rounding the split count up (the old rule) put 20 column tiles x 7 = 140 programs on
    132 SMs: 8 programs in a second wave. Now one wave of 120."""
    monkeypatch.setattr(geometry, "sm_count", lambda t: 132)
    bf16_rows = torch.empty(0, device="meta", dtype=torch.bfloat16)
    plan = gemm.gemm_plan(128, 2496, 27358, bf16_rows)
    assert (plan.block_n, plan.splits) == (128, 6)
    assert gemm.wave_fill(20 * 7, 132) < 0.6 < gemm.wave_fill(20 * 6, 132) == 120 / 132


def test_a_wide_short_gemm_takes_narrower_panels_where_a_split_moves_more_than_its_weight(
    on_gpu_sizes, monkeypatch
):
    """The down GEMM's dy W^T at 130M (N = 10,496, K = 2,496): 8 splits at B = 128 would
    write and read back 86 MB of float32 partials for a 52 MB weight; 64-wide panels fill
    the 132 SMs unsplit (164 programs). At B = 16 the partials are a fifth of the weight:
    split as before."""
    monkeypatch.setattr(geometry, "sm_count", lambda t: 132)
    t = torch.empty(0, device="meta")
    wide = gemm.gemm_plan(128, 10496, 2496, t)
    assert (wide.block_m, wide.block_n, wide.splits) == (128, 64, 1)
    assert wide.grid(128, 10496) == (1, 164)
    small = gemm.gemm_plan(16, 10496, 2496, t)
    assert small.block_n == 128 and small.splits > 1
    assert not gemm._partials_outweigh(small.splits, 16, 10496, 2496)
    # A d-wide output with a long K keeps its split: the partials are a few % of the weight.
    assert gemm.gemm_plan(128, 2496, 27358, t).splits > 1


@pytest.mark.parametrize("M", [16, 64, 128, 256])
def test_a_float32_operand_over_a_long_k_takes_wide_panels_with_the_same_weight_in_flight(
    on_gpu_sizes, M, monkeypatch
):
    """The input GEMM's dy W^T (the float32 dY rows, K = 27,358 at 130M) re-reads its A rows
    in every column panel: 256-wide panels read them half as often, in half the programs.
    Where the accumulator takes 128 floats a thread, 32-deep K tiles and 5 stages; else
    64-deep and 3: either way 64 KB of weight tiles ahead of the one in use."""
    monkeypatch.setattr(geometry, "sm_count", lambda t: 132)
    rows = torch.empty(0, device="meta", dtype=torch.float32)
    plan = gemm.gemm_plan(M, 2496, 27358, rows)
    assert plan.block_n == gemm.WIDE_PANEL_N and plan.splits > 1
    per_thread = plan.block_m * plan.block_n // (32 * plan.warps)
    assert (plan.block_k, plan.stages) == ((32, 5) if per_thread >= 128 else (64, 3))
    assert (plan.stages - 1) * plan.block_k * plan.block_n * 2 == 64 * 1024
    assert plan.k_per_split % plan.block_k == 0
    if M == 128:
        assert plan.grid(M, 2496) == (1, 10, 8)  # 80 programs: 52 SMs left to the side work
    # bf16 rows (read once as they are), a short K or IEEE products: the 128-wide panels.
    bf16_rows = torch.empty(0, device="meta", dtype=torch.bfloat16)
    assert gemm.gemm_plan(M, 2496, 27358, bf16_rows).block_n == gemm.GEMM_BLOCK_N
    assert gemm.gemm_plan(M, 2496, 2496, rows).block_n == gemm.GEMM_BLOCK_N
    assert gemm.gemm_plan(M, 2496, 27358, rows, ieee=True).block_n < gemm.WIDE_PANEL_N
    with execution(assumed_arch=80):  # mma.sync holds operand fragments in registers: spilled
        assert gemm.gemm_plan(M, 2496, 27358, rows).block_n == gemm.GEMM_BLOCK_N


@pytest.mark.parametrize(
    "shape", [(27358, 2496, 0), (2496, 3840 + 6656, 3840), (3840 + 6656, 2496, 0)]
)
@pytest.mark.parametrize("M", [64, 128, 256])
def test_bf16_rows_in_128_row_blocks_keep_more_weight_tiles_ahead(on_gpu_sizes, shape, M):
    """From 128-row blocks of bf16 A: 32-deep K tiles 6 stages deep, the shared memory of
    64-deep ones 3 deep (as many programs per SM) with 5 weight tiles ahead of the one in use
    instead of 2; float32 A rows and fewer rows keep 64-deep tiles 3 stages deep."""
    N, K, k1 = shape
    bf16_rows = torch.empty(0, device="meta", dtype=torch.bfloat16)
    plan = gemm.gemm_plan(M, N, K, bf16_rows, k1)
    deep = plan.block_m == 128
    assert deep == (M >= 128)
    assert (plan.block_k, plan.stages) == (gemm.DEEP_PIPELINE if deep else (64, 3))

    def ring(bk: int, stages: int) -> int:  # the pipeline's shared memory: A and W tiles
        return stages * (plan.block_m * bk + bk * plan.block_n) * 2

    assert ring(plan.block_k, plan.stages) == ring(64, 3)
    assert (plan.stages - 1) * plan.block_k > 2 * 64 or not deep
    assert plan.k_per_split % plan.block_k == 0
    float32_rows = torch.empty(0, device="meta", dtype=torch.float32)
    assert gemm.gemm_plan(M, N, K, float32_rows, k1).stages != gemm.DEEP_PIPELINE[1]
