"""accounting/gemm_routes.py: a device run's Triton step GEMMs held against cuBLAS at the same
shapes, and the `engine.cublas_gemms` value that gives; read back by `gpu_model --against`."""

from __future__ import annotations

import json

import pytest

from gpn_scale.accounting import device_runs, gemm_routes, gpu_model, gpu_report
from gpn_scale.models.gpn import load_model_config
from gpn_scale.ops.gpn_step.options import PROJECTIONS


def test_every_projection_engine_cublas_gemms_names_has_its_triton_roles():
    assert tuple(gemm_routes.GEMM_ROLES) == PROJECTIONS


@pytest.mark.parametrize(
    "role, projection, extra",
    [
        ("input GEMM 0", "input", None),
        ("input GEMM 1", "input", None),
        ("first-step input GEMM 0", None, None),  # once a chunk, from the float32 carry
        ("down GEMM 1 (split-K sum)", "down", None),
        ("down GEMM read 0", "down", None),  # under tp
        ("input dy W^T 0", "input_dx", None),
        ("fuse-gate dy W^T", "fuse_gate_dx", None),
        ("row backward", None, None),
        # what the cuBLAS route records
        ("down GEMM 0 (cuBLAS)", None, None),
        ("down GEMM 0 (epilogue)", None, "down"),
        ("input dy W^T 0 A to bfloat16", None, "input_dx"),
        ("fuse-gate GEMM row sums of squares", None, "fuse_gate"),
        ("first-step input GEMM 0 (epilogue)", None, None),
    ],
)
def test_roles_are_read_as_their_projection(role, projection, extra):
    assert gemm_routes.projection_of(role) == projection
    assert gemm_routes.extra_projection(role) == extra


def _ledger_row(role: str, batch: int, s_per_step: float, flops: int, launches: int = 4) -> dict:
    return {"config": "m", "batch": batch, "role": role, "s_per_step": s_per_step,
            "flops": flops, "launches_per_chunk": launches}  # fmt: skip


def test_compare_sums_a_projections_launches_and_adds_the_routes_extras():
    """Per training step: Triton's GEMM and its split-K sum (measured, in sequence) against
    cuBLAS's product (measured alone, times the GEMM's launches a step) plus what its route
    adds (predicted); a projection timed at another shape is not compared."""
    shape = {"down": (8, 64, 32), "down_dx": (8, 32, 64), "input": (8, 32, 96)}
    flops = {p: 2 * m * k * n for p, (m, k, n) in shape.items()}
    ledger = [
        _ledger_row("down GEMM 0", 8, 0.010, flops["down"]),
        _ledger_row("down GEMM 0 (split-K sum)", 8, 0.004, 0),
        _ledger_row("down dy W^T 0", 8, 0.010, flops["down_dx"]),
        _ledger_row("input GEMM 0", 8, 0.010, flops["input"] + 2),  # not the timed shape
        _ledger_row("row backward", 8, 0.5, 0),
    ]
    gemms = [{"role": p, "shape": list(s), "seconds": 1e-5} for p, s in shape.items()] + [
        {"role": "fuse_gate", "shape": [8, 32, 32], "error": "out of memory"}
    ]
    # 4 launches a chunk of 4 steps over 16 steps: 16 launches a training step
    rows = gemm_routes.compare(ledger, gemms, 4, 16, {8: {"down": 0.002}})
    by = {r["projection"]: r for r in rows}
    assert set(by) == {"down", "down_dx"}
    assert by["down"]["triton_s"] == pytest.approx(0.014)
    assert by["down"]["cublas_product_s"] == pytest.approx(16e-5)
    assert by["down"]["cublas_s"] == pytest.approx(0.002 + 16e-5)
    assert by["down"]["faster"] == "cuBLAS" and by["down_dx"]["faster"] == "cuBLAS"
    assert gemm_routes.setting(rows) == "down,down_dx"
    slower = gemm_routes.compare(ledger, gemms, 4, 16, {8: {"down": 0.02}})
    assert gemm_routes.setting(slower) == "down_dx"
    assert gemm_routes.setting([]) == "none"
    lines = gemm_routes.table(slower)
    assert "| down | 8 | 8 x 64 x 32 | 0.0140 | 0.0002 | 0.0200 | 0.0202 | Triton |" in lines
    assert lines[-1] == "Whichever is faster at every batch: engine.cublas_gemms=down_dx"


def test_a_projection_faster_through_cublas_at_one_batch_only_stays_triton():
    flops = 2 * 8 * 32 * 64
    ledger = [
        _ledger_row("down dy W^T 0", 8, 0.010, flops),
        _ledger_row("down dy W^T 0", 16, 1e-6, 2 * flops),
    ]
    gemms = [
        {"role": "down_dx", "shape": [8, 32, 64], "seconds": 1e-5},
        {"role": "down_dx", "shape": [16, 32, 64], "seconds": 1e-5},
    ]
    rows = gemm_routes.compare(ledger, gemms, 4, 16, {})
    assert [r["faster"] for r in rows] == ["cuBLAS", "Triton"]
    assert gemm_routes.setting(rows) == "none"


def test_against_compares_the_runs_gemms_with_cublas_at_their_shapes(tmp_path, capsys):
    """A run whose ledger timed the tiny model's down dy W^T and whose ceilings timed
    cuBLAS at that shape: `--against` sets one against the other, the cuBLAS route's added
    launches priced from this tree's, and names the setting."""
    run = tmp_path / "2027-01-01-h200"
    run.mkdir()
    cfg = load_model_config("tiny")
    acc = gpu_model.account(cfg, batch=2, seq_len=8)
    (down_dx,) = {op.name for op in acc.ops if op.name.endswith("down dy W^T 0")}
    flops = next(op.flops for op in acc.ops if op.name == down_dx)
    m, k, n = 2, cfg.d_state, flops // (2 * 2 * cfg.d_state)
    rows = [{"batch": 2, "tokens_per_s": 1000.0, "step_s": 0.016, "mfu": None}]
    blob = {
        "meta": {"device_name": "NVIDIA H200", "seq_len": 8, "cuda_graphs": True},
        "summary": {"tiny": {"config": "tiny", "rows": rows}, device_runs.HEADLINE: None},
        "ceilings": {"copy_bytes_per_s": 2.0e12,
                     "gemms": [{"role": "down_dx", "shape": [m, k, n], "seconds": 1e-7,
                                "gbytes_per_s": 1000.0}]},
        "ledger": {"rows": [{"config": "tiny", "batch": 2, "role": "down dy W^T 0",
                             "s_per_step": 1e-3, "flops": flops, "launches_per_chunk": 8}]},
    }  # fmt: skip
    (run / device_runs.RESULTS).write_text(json.dumps(blob))
    result = gpu_report.against("tiny", str(run))
    (row,) = result["gemm_routes"]
    assert row["projection"] == "down_dx" and row["batch"] == 2
    launches = 8 * 8 / cfg.engine.chunk_size  # a chunk's launches over the window's chunks
    assert row["triton_s"] == 1e-3 and row["cublas_product_s"] == pytest.approx(1e-7 * launches)
    assert row["cublas_extra_s"] == 0.0  # a plain product of a bf16 dZ: nothing added
    assert row["faster"] == "cuBLAS"
    assert gpu_model.main(["tiny", "--against", str(run)]) == 0
    out = capsys.readouterr().out
    assert "Whichever is faster at every batch: engine.cublas_gemms=down_dx" in out
