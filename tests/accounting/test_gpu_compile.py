"""The ahead-of-time compile gate (gpn_scale/accounting/gpu_compile.py): every kernel variant the
CUDA path launches at the shipped configs, compiled for sm_90 and sm_80 without a GPU, with
no compile error, no spill, shared memory within the target's limit, step GEMMs that fill
the SMs and read their weights 16 bytes at a time; and offsets past 2**31 in 64 bits.

The gate itself runs as the command (a subprocess without TRITON_INTERPRET: the tests'
own process runs the kernels in the interpreter); the parsing and the checks it is made of
are tested here directly."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from gpn_scale.accounting import gpu_compile as gc
from gpn_scale.ops import launch
from gpn_scale.ops.gpn_step.gemm import MAX_SPLITS, wave_fill
from gpn_scale.ops.gpn_step.interface import LoopWeights, aligned_rows

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gate_compiles_every_kernel_of_the_shipped_configs_for_sm90_and_sm80(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env[gc.CACHE_ENV] = str(tmp_path / "facts-cache.json")  # starts empty: every compile cold
    out = tmp_path / "facts.json"
    triton_cache = tmp_path / "triton-cache"  # filled as a process's TRITON_CACHE_DIR would be
    proc = subprocess.run(
        [sys.executable, "-m", "gpn_scale.accounting.gpu_compile", "--gate", "--json", str(out)]
        + ["--triton-cache", str(triton_cache)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "no compile errors, no spills" in proc.stdout
    rows = json.loads(out.read_text())
    assert {r["target"] for r in rows} == {"sm_90", "sm_80"}
    kernels = {r["kernel"] for r in rows}
    # Every kernel of the step backend, the tp split points (the 1B rank), the decode and
    # the chunk-wide fused chains.
    assert kernels >= {
        "linear_kernel",
        "linear_reduce_kernel",
        "memory_forward_kernel",
        "memory_backward_kernel",
        "rev_row_kernel",
        "rev_start_kernel",
        "l2n_relu_kernel",
        "gated_residual_kernel",
        "read_norm_sums_kernel",
        "softmax_xent_kernel",
        # the recompute's and the weight gradients' fused chains (ops/gpn_step/fused.py)
        "rms_rows_kernel",
        "l2n_relu_rows_kernel",
        "down_input_kernel",
        "cast_column_sums_kernel",
    }
    assert all(r["ok"] and r["spill_stores"] == 0 and r["stack"] == 0 for r in rows)
    step_gemms = [
        r
        for r in rows
        if r["case"] == "gpn_m_130m bf16 B=16"
        and r["target"] == "sm_90"
        and r["kernel"] == "linear_kernel"
        and not any(n.startswith("first key") for n in r["names"])
    ]
    assert len(step_gemms) >= 6
    for r in step_gemms:
        programs = min(a * b * (c[0] if c else 1) for a, b, *c in r["grids"])
        # at the split cap (the wide panels: too few column tiles for a wave) exempt
        capped = all(c and c[0] >= MAX_SPLITS for _, _, *c in r["grids"])
        assert capped or wave_fill(programs, 132) >= gc.MIN_WAVE_FILL, r["names"]
        assert min(int(w) for w in r["loads"]["W"]) == 16, r["names"]
    # Every sequential kernel of the shipped configs keeps two programs per SM or 48 KB of
    # asynchronous copies in flight, but the ones the gate names as known misses.
    sequential = [
        r
        for r in rows
        if r["case"].startswith(("gpn_m_130m ", "gpn_m_130m_2l "))
        and set(r["phases"]) <= set(gc.STEP_PHASES)
        and r["kernel"] not in gc.BELOW_OCCUPANCY_BAR
    ]
    assert {r["kernel"] for r in sequential} >= {
        "memory_backward_kernel",
        "memory_backward_flush_kernel",
        "linear_kernel",
    }
    for r in sequential:
        ring = r["shared"] * r["blocks_per_sm"] if r["kernel"] == "linear_kernel" else 0
        assert r["blocks_per_sm"] >= 2 or ring >= 48 * 1024, (r["kernel"], r["names"])
    assert ("known, below the occupancy bar" in proc.stdout) == bool(gc.BELOW_OCCUPANCY_BAR)
    # The memory kernels' loops and the decode's cross-entropy passes are software-pipelined
    # at every shipped size and target: their tiles come through cp.async (what the
    # accounting prices them as).
    assert set(gc.PIPELINED_OPERANDS) == {
        "memory_backward_kernel",
        "memory_forward_kernel",
        "softmax_xent_kernel",
    }
    shipped = [r for r in rows if r["case"].startswith(("gpn_m_130m ", "gpn_m_130m_2l "))]
    for r in shipped:
        if r["kernel"] in gc.PIPELINED_OPERANDS:
            loaded = set(gc.PIPELINED_OPERANDS[r["kernel"]]) & set(r["loads"])
            assert loaded and loaded <= set(r["async_operands"]), (r["case"], r["target"])
    # Under bf16 weights a step GEMM reads bf16 A unless the gate names why not; the down
    # GEMM's (the memory kernel's output) is bf16.
    for r in step_gemms:
        assert r["signature"]["W"] == "*bf16"
        roles = {re.sub(r" \d+$", "", n) for n in r["names"]}
        assert r["signature"]["A"] == "*bf16" or roles <= set(gc.FLOAT32_A_OPERANDS), roles
    assert any(r["signature"]["A"] == "*bf16" and "down GEMM 0" in r["names"] for r in step_gemms)
    assert "known, step GEMMs reading a float32 A operand" in proc.stdout
    # engine.bf16_memory_reads (off by default): its memory kernels load M0 as bf16, through
    # cp.async, on both targets (the checks above hold their occupancy and spills)
    bf16_reads = [r for r in rows if "bf16_memory_reads=True" in r["case"]]
    assert {(r["kernel"], r["target"]) for r in bf16_reads if r["signature"].get("M0")} == {
        (k, t)
        for k in ("memory_forward_kernel", "memory_backward_kernel")
        for t in ("sm_90", "sm_80")
    }
    for r in bf16_reads:
        if r["signature"].get("M0"):
            assert r["signature"]["M0"] == "*bf16" and "m0_base" in r["async_operands"]

    # The Triton cache holds every variant as the JIT keys it: compiling one case again
    # into it is all cache hits (no ptxas run, so no ptxas log).
    again = tmp_path / "again.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpn_scale.accounting.gpu_compile",
            "testing_tiny",
            "--dtype",
            "fp32",
        ]
        + ["--batch", "3", "--arch", "sm_90", "--triton-cache", str(triton_cache)]
        + ["--json", str(again)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    hits = json.loads(again.read_text())
    assert hits and all(r["ok"] and not r["logged"] for r in hits)

    # The accounting prices the same compiled variants (the facts cache the gate filled),
    # and puts the Transformer++ of the same size beside it.
    acc = subprocess.run(
        [sys.executable, "-m", "gpn_scale.accounting.gpu_model", "gpn_m_130m", "--batch", "16"]
        + ["--gpu", "h200", "--compiled", "sm_90"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert acc.returncode == 0, acc.stderr[-3000:]
    said = r"Kernel facts \(occupancy, pipelining, instructions\): (\{.*?\})"
    facts = re.search(said, acc.stdout)
    assert facts and set(ast.literal_eval(facts.group(1))) == {"compiled"}, acc.stdout[-2000:]
    ratio = re.search(
        r"\| H200 \| [\d,]+ \| [\d,]+ \([\d.]+%\) \| [\d,]+ \([\d.]+%\) \| ([\d.]+) \|",
        acc.stdout,
    )
    assert ratio and 0 < float(ratio.group(1)) < 10, acc.stdout[-2000:]


# ----------------------------------------------------------------- what the gate reads
PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'memory_backward_kernel' for 'sm_90a'
ptxas info    : Function properties for memory_backward_kernel
    7672 bytes stack frame, 20432 bytes spill stores, 25672 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 2048 bytes smem
"""


def test_ptxas_log_gives_registers_stack_and_spills():
    assert gc.parse_ptxas_log(PTXAS_LOG) == dict(
        stack=7672, spill_stores=20432, spill_loads=25672, registers=32
    )


def test_ptx_loads_are_attributed_to_their_source_operand(tmp_path):
    src = tmp_path / "k.py"
    src.write_text("a = 1\nw = tl.load(\n    W + rk\n)\nx = tl.load(X + 1)\n")
    ptx = f"""
	.file	1 "{src}"
	.loc	1 2 8
	@%p7 ld.global.b16 {{ %rs1 }}, [ %rd1 + 0 ];
	ld.global.b16 {{ %rs2 }}, [ %rd2 + 0 ];
	.loc	1 5 4
	ld.global.v4.b32 {{ %r1, %r2, %r3, %r4 }}, [ %rd3 + 0 ];
	cp.async.cg.shared.global [ %r5 + 0 ], [ %rd4 + 0 ], 0x10, %r6;
"""
    loads = gc.parse_ptx_loads(ptx, gc.source_operands(str(src)), str(src))
    assert loads == {"W": {2: 2}, "X": {16: 2}}


def test_instructions_outside_loops_are_counted_by_the_lines_they_stand_on(tmp_path):
    """Each instruction outside the loops under its `.loc` line and every line it was
    inlined at (a chain of `.loc`s for a helper in a helper); none of another file's, none
    before the first `.loc`, none in a loop."""
    from gpn_scale.accounting.gpu_compile_ptx import line_instructions

    src, other = tmp_path / "k.py", tmp_path / "o.py"
    src.write_text("\n" * 100)
    other.write_text("")
    ptx = f"""
	.file	1 "{src}"
	.file	2 "{other}"
	ld.param.b64 	%rd1, [k_param_0];
	.loc	1 10 4
	add.s32 	%r1, %r2, 1;
	add.s32 	%r1, %r2, 1;
	.loc	1 20 4, function_name $L__info_string0, inlined_at 1 10 4
	.loc	1 30 5, function_name $L__info_string0, inlined_at 1 20 4
	mul.f32 	%r3, %r4, %r5;
	.loc	1 31 5, function_name $L__info_string0, inlined_at 1 20 4
	mul.f32 	%r3, %r4, %r5;
$L__BB0_1:
	.loc	1 40 4
	add.s32 	%r6, %r6, 1;
	@%p1 bra 	$L__BB0_1;
	.loc	2 5 1
	mov.u32 	%r7, 0;
	.loc	1 50 4, function_name $L__info_string0, inlined_at 1 99 1
	mov.u32 	%r8, 0;
"""
    assert line_instructions(ptx, str(src)) == [
        [2, 10],
        [1, 10, 20, 30],
        [1, 10, 20, 31],
        [1, 99, 50],
    ]


def test_blocks_per_sm_follow_registers_warps_and_shared_memory():
    h100 = gc.TARGETS["sm_90"]
    assert h100.blocks_per_sm(255, 8, 4096) == 1  # 8 warps x 32 x 256 registers: one block
    assert h100.blocks_per_sm(128, 8, 4096) == 2
    assert h100.blocks_per_sm(32, 4, 0) == 16  # warps: 64 / 4
    assert h100.blocks_per_sm(32, 1, 100_000) == 2  # shared memory
    assert gc.TARGETS["sm_80"].blocks_per_sm(32, 1, 100_000) == 1


# --------------------------------------------------------------------------- offsets
@triton.jit
def _row_copy(X, stride_x, Y, stride_y: tl.int64, N, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    r = tl.arange(0, BLOCK)
    tl.store(Y + b * stride_y + r, tl.load(X + b * stride_x + r, mask=r < N), mask=r < N)


def test_offsets_past_2_31_need_a_64_bit_stride_and_the_engine_has_them():
    wide = torch.empty(2**20, 2**12, device="meta")  # 2**32 elements
    rec = launch.Launch("copy", "test", (1,), 0, 0, _row_copy, (wide, 2**12, wide, 2**12, 16))
    found = gc.narrow_offsets([rec])
    assert len(found) == 1 and "X spans" in found[0] and "stride_x" in found[0]
    narrow = torch.empty(4, 16, device="meta")
    small = launch.Launch("copy", "test", (1,), 0, 0, _row_copy, (narrow, 16, narrow, 16, 16))
    assert gc.narrow_offsets([small]) == []
    # The engine's launches at a batch whose (B, T, d) views span past 2**31 elements.
    case = gc.Case("gpn_m_130m", 8192)
    records = gc.record_launches(case)
    assert (
        max(gc._extent(a) for r in records for a in r.args if isinstance(a, torch.Tensor)) > 2**31
    )
    assert gc.narrow_offsets(records) == []


# --------------------------------------------------------------------- aligned weights
def test_matmul_copies_of_the_loop_weights_have_16_element_row_strides():
    w = torch.randn(5, 27, dtype=torch.float64)
    a = aligned_rows(w, 16, torch.float32)
    assert a.stride() == (32, 1) and a.dtype == torch.float32
    torch.testing.assert_close(a, w.float())
    W = LoopWeights([w], [torch.zeros(27)], [w.t()], torch.randn(5, 5), torch.zeros(5), None)
    for m in (W.for_matmul(torch.bfloat16, 16), W.transposed(16)):
        assert all(t.stride(0) % 16 == 0 and t.stride(1) == 1 for t in (*m.w_in, *m.w_out, m.w_fg))
    assert W.for_matmul(None, 1) is W  # the CPU backends: no copy


def test_the_cuda_backend_gemms_read_aligned_weights(monkeypatch):
    """Every weight the CUDA backend's GEMMs read (dry run of the tiny config, whose fused
    input matrix is not 16 columns wide) has a 16-element row stride."""
    monkeypatch.delenv("GPN_SCALE_STEP_KERNELS", raising=False)
    records = gc.record_launches(gc.Case("testing_tiny", 3, dtype="fp32"))
    weights = [
        r.args[3]
        for r in records
        if r.kernel is not None and r.kernel.fn.__name__ == "linear_kernel"
    ]
    assert any(w.shape[1] % 16 for w in weights)  # unpadded, some rows would be unaligned
    assert all(w.stride(0) % 16 == 0 and w.stride(1) == 1 for w in weights)


def test_every_dot_names_its_output_dtype():
    """Triton before 3.7 gives tl.dot a float32 result unless `out_dtype` says otherwise,
    whatever the accumulator: an fp64 accumulator then fails to compile (the H200 image's
    triton 3.6: 'CompilationError ... acc.type.element_ty == out_dtype' in every fp64 GEMM
    of the device check) and an fp64 product without one is rounded to float32. The gate
    compiles with this machine's Triton, which infers the dtype, so it is checked here."""
    import ast

    kernels = ROOT / "gpn_scale" / "ops"
    dots = []
    for path in kernels.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "dot"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "tl"
            ):
                dots.append((path.name, node.lineno, {k.arg for k in node.keywords}))
    assert len(dots) >= 7  # the step GEMM and the block flush: the scan finds them
    missing = [f"{name}:{line}" for name, line, keys in dots if "out_dtype" not in keys]
    assert not missing, f"tl.dot without out_dtype at {missing}"
