"""The launch accounting (gpn_scale.accounting.gpu_model) counts what the CUDA backend's code path
really launches, and `gpn-scale sweep plan` prices with its prediction."""

from __future__ import annotations

import re
import textwrap
from collections import Counter

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from gpn_scale.accounting import gpu_model, step_model
from gpn_scale.models.gpn import ConfigError, load_model_config
from gpn_scale.models.registry import family_of
from gpn_scale.ops import launch
from gpn_scale.ops.gpn_step.registry import ENV_VAR
from gpn_scale.scaling.sweep import SweepError, format_plan, load_sweep
from gpn_scale.testing.models import perturbed_model, tiny_config


@pytest.mark.parametrize("layers,memory", [(1, True), (2, True), (3, True), (1, False)])
def test_launches_per_step_counted_from_the_code_path(layers, memory):
    cfg = tiny_config(n_layers=layers, memory=memory, chunk_size=4)
    acc = gpu_model.account(cfg, batch=3, seq_len=16)
    assert _kernels(acc, "sequential forward") == 3 * layers + 1
    # GPN+M: the read norm's backward sums, once per row, before each memory kernel
    assert _kernels(acc, "sequential backward") == (5 if memory else 4) * layers + 2


def _kernels(acc, phase: str) -> float:
    """Launches per step less the split-K sums (their number depends on the shapes: one
    after each GEMM whose grid is split over K to fill the SMs)."""
    return acc.launches_per_step(phase) - acc.split_sums_per_step(phase)


@pytest.mark.parametrize("layers,memory", [(1, True), (2, True), (1, False), (2, False)])
def test_launches_and_collectives_per_step_under_tp_counted_from_the_code_path(layers, memory):
    """One rank of tp = 2: the down GEMM's epilogue split off (the gated residual after the
    all-reduce of its row-parallel output; GPN+M: two down GEMMs, the read part and the FFN
    part, summed with the read norm's sums of squares in one all-reduce), the input
    gradient's predict-gate share a second GEMM after the all-reduce, and GPN+M's read-norm
    backward sums a kernel and an all-reduce of their own."""
    # vocab 40: the tied embedding is vocabulary-parallel, so it must split over tp too
    cfg = tiny_config(n_layers=layers, memory=memory, chunk_size=4, vocab_size=40)
    acc = gpu_model.account(cfg, batch=3, seq_len=16, tp=2)
    per_layer = 2 if memory else 1
    assert _kernels(acc, "sequential forward") == (3 + per_layer) * layers + 1
    assert _kernels(acc, "sequential backward") == (4 + per_layer) * layers + 2
    assert acc.collectives_per_step("sequential forward") == layers
    assert acc.collectives_per_step("sequential backward") == per_layer * layers
    one = gpu_model.account(cfg, batch=3, seq_len=16)
    assert one.collectives_per_step("sequential backward") == 0


@pytest.mark.slow
def test_dry_accounting_matches_a_real_run(monkeypatch):
    """The same launches, one by one, when the kernels really run (Triton's interpreter)."""
    cfg = tiny_config(n_layers=2, chunk_size=4, step_backend="cuda", cuda_graphs=False)
    monkeypatch.delenv(ENV_VAR, raising=False)
    model = perturbed_model(cfg, torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with launch.recording() as real:
        model(tokens).loss.backward()
    dry = gpu_model.account(cfg, batch=2, seq_len=8).ops
    # Split-K sums follow the GEMMs split to fill the SMs, a choice of the block sizes (the
    # interpreter's 16-wide tiles split where the GPU's 64-wide ones do not): compared apart.
    real_names = [f"{r.phase}: {r.name}" for r in real]
    for i, name in enumerate(real_names):
        if name.endswith(gpu_model.SPLIT_SUM):
            assert real_names[i - 1] == name.removesuffix(" " + gpu_model.SPLIT_SUM)
    steps = [op.name for op in dry if op.triton and op.phase in gpu_model.SEQUENTIAL]
    assert [n for n in steps if gpu_model.SPLIT_SUM not in n] == [
        n for n in real_names if gpu_model.SPLIT_SUM not in n
    ]
    # On CUDA (and so in the dry run) the decode's cross-entropy is a Triton kernel too.
    assert any(op.triton and op.phase == "decode" for op in dry)


def test_prediction_on_the_paper_model_has_floor_below_it_and_graphs_help_small_batches():
    cfg = load_model_config("gpn_m_130m")
    acc = gpu_model.account(cfg, batch=64, seq_len=256)
    assert acc.launches_per_step("sequential forward") <= 8
    assert acc.launches_per_step("sequential backward") <= 12
    for gpu in gpu_model.GPUS.values():
        p = gpu_model.predict(acc, gpu, graphs=True, cfg=cfg)
        assert 0 < p.floor_seconds < p.seconds and 0 < p.mfu < 1
    small = gpu_model.account(cfg, batch=1, seq_len=128)
    h200 = gpu_model.GPUS["h200"]
    assert (
        gpu_model.predict(small, h200, graphs=True).seconds
        < gpu_model.predict(small, h200, graphs=False).seconds
    )
    before = gpu_model.account(cfg, batch=64, seq_len=256, backend="reference")
    assert before.launches_per_step("sequential forward") > 8 * 4


def test_backward_side_work_hides_only_where_the_sweep_leaves_sms_free():
    """engine.overlap_backward: the recompute and weight gradients are hidden up to the SM
    time the reverse sweep's launches leave free (and its gaps), never beyond the side work
    itself; with the option off nothing is hidden."""
    cfg = load_model_config("gpn_m_130m")
    h200 = gpu_model.GPUS["h200"]
    for batch in (1, 64):
        acc = gpu_model.account(cfg, batch=batch, seq_len=256)
        on = gpu_model.predict(acc, h200, graphs=True, cfg=cfg)
        off = gpu_model.predict(acc, h200, graphs=True, cfg=cfg, overlap=False)
        side = sum(on.per_phase_seconds[ph] for ph in gpu_model.SIDE_WORK)
        assert off.overlapped_seconds == 0 and off.per_phase_seconds == on.per_phase_seconds
        assert 0 < on.overlapped_seconds <= side
        assert on.seconds == pytest.approx(off.seconds - on.overlapped_seconds)
    # One sequence fills few SMs: nearly all the side work (but the first chunk's recompute
    # and the last one's weight gradients) hides.
    small = gpu_model.account(cfg, batch=1, seq_len=256)
    p = gpu_model.predict(small, h200, graphs=True, cfg=cfg)
    chunks = 256 // cfg.engine.chunk_size
    side = sum(p.per_phase_seconds[ph] for ph in gpu_model.SIDE_WORK)
    assert p.overlapped_seconds == pytest.approx(side * (chunks - 1) / chunks)


def test_decode_hides_beside_the_forward_steps_but_its_last_piece():
    """engine.overlap_decode: each decode piece but the last runs beside the next chunks'
    forward steps, hidden up to the SM time they leave free; off (or under tp, where the
    engine decodes inline) nothing is; one piece (a short window at batch 1) hides nothing."""
    cfg = load_model_config("gpn_m_130m")
    h200 = gpu_model.GPUS["h200"]
    acc = gpu_model.account(cfg, batch=64, seq_len=256)
    on = gpu_model.predict(acc, h200, graphs=True, cfg=cfg)
    off = gpu_model.predict(acc, h200, graphs=True, cfg=cfg, overlap_decode=False)
    pieces = step_model.decode_pieces(64, 256, cfg.engine.chunk_size, 1024)
    assert pieces == 256 // cfg.engine.chunk_size
    assert off.decode_overlapped_seconds == 0
    most = on.per_phase_seconds["decode"] * (pieces - 1) / pieces
    assert 0 < on.decode_overlapped_seconds <= most
    assert on.seconds == pytest.approx(off.seconds - on.decode_overlapped_seconds)
    acc.tp = 2
    assert gpu_model.predict(acc, h200, graphs=True, cfg=cfg).decode_overlapped_seconds == 0
    short = gpu_model.account(cfg, batch=1, seq_len=256)
    assert step_model.decode_pieces(1, 256, cfg.engine.chunk_size, 1024) == 1
    assert gpu_model.predict(short, h200, graphs=True, cfg=cfg).decode_overlapped_seconds == 0


def test_cli_prints_the_table_and_refuses_an_unknown_gpu(capsys):
    assert gpu_model.main(["tiny", "--batch", "2", "--seq-len", "8"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"Launches per time step \(CUDA backend\): forward 4( \+ \d split-K sums)?, reverse "
        r"sweep 7( \+ \d split-K sums)?",
        out,
    )
    assert "| H200 | CUDA backend, graphs on |" in out
    assert gpu_model.main(["tiny", "--gpu", "a100"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown GPU a100" in err
    assert gpu_model.main(["tiny", "--batch", "2", "--seq-len", "8", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"Launches per time step \(CUDA backend\): forward 6( \+ \d split-K sums)?, reverse "
        r"sweep 8( \+ \d split-K sums)?",
        out,
    )
    assert "tp = 2; all-reduces per time step: forward 1, reverse sweep 2" in out
    assert gpu_model.main(["tiny", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.n_heads" in err and "tp=3" in err
    assert gpu_model.main(["tiny", "--batch", "2", "--baseline", "gpn_m_130m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--baseline gpn_m_130m: a GPN config, the family" in err


def test_bf16_memory_reads_halve_the_m0_bytes_of_the_memory_kernels(capsys):
    """engine.bf16_memory_reads: each memory kernel's launch reads M0's cells in 2 bytes, not
    4, and nothing else it moves changes; the CLI prices the option (`--engine`) and refuses
    a malformed or unknown one in one line."""
    cfg = tiny_config(n_layers=2, chunk_size=4)
    B, T = 3, 8

    def kernels(c):  # the Triton launches (the ATen ops gain the copy's casts)
        return [op for op in gpu_model.account(c, batch=B, seq_len=T).ops if op.triton]

    plain, bf16 = kernels(cfg), kernels(cfg.replace(bf16_memory_reads=True))
    assert [op.name for op in plain] == [op.name for op in bf16]
    m0_cells = B * cfg.n_heads * cfg.d_key * cfg.d_value
    saved = {(a.name.split(": ")[1], a.bytes - op.bytes) for a, op in zip(plain, bf16)}
    # each memory kernel of each layer, every step; and a graph's copy of M0 into its static
    # input (copied in by the forward and the reverse graphs alike); nothing else
    changed = {(name, d) for name, d in saved if d}
    assert {name for name, _ in changed} == {
        "memory/FFN 0",
        "memory/FFN 1",
        "memory/FFN backward 0",
        "memory/FFN backward 1",
        "graph copies in/out",
    }
    for name, d in changed:
        assert d % (2 * m0_cells) == 0 if name.startswith("graph") else d == 2 * m0_cells
    # the floor streams M0 as the steps read it: 2 bytes a cell less, forward and reverse
    h200 = gpu_model.GPUS["h200"]
    exact, low = (
        gpu_model.predict(gpu_model.account(c, batch=B, seq_len=T), h200, graphs=True, cfg=c)
        for c in (cfg, cfg.replace(bf16_memory_reads=True))
    )
    saved_s = 2 * T * 2 * m0_cells / h200.copy_bytes_per_s
    assert exact.floor_seconds - low.floor_seconds == pytest.approx(saved_s, rel=1e-9)
    assert (
        gpu_model.main(
            ["tiny", "--batch", "2", "--seq-len", "8", "--engine", "bf16_memory_reads=true"]
        )
        == 0
    )
    assert "| H200 | CUDA backend, graphs on |" in capsys.readouterr().out
    for bad, said in (
        ("bf16_memory_reads", "expected KEY=VALUE"),
        ("bf16_memory_read=true", "did you mean 'bf16_memory_reads'"),
        ("bf16_memory_reads=2", "expected true or false"),
    ):
        assert gpu_model.main(["tiny", "--engine", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err


def test_cublas_gemms_replace_each_projections_triton_gemms_with_cublas_launches(capsys):
    """engine.cublas_gemms: the projections it names record a cuBLAS product (its FLOPs
    those of the Triton GEMM it replaces) and, where they have one, a reduce kernel for the
    scale and epilogue; the others keep their Triton GEMMs. The CLI prices it."""
    cfg = tiny_config(n_layers=2, chunk_size=4)
    B, T = 3, 8

    def ops(c):
        return gpu_model.account(c, batch=B, seq_len=T).ops

    def gemm_flops(found, cublas):
        return sum(op.flops for op in found if op.cublas == cublas and op.flops)

    plain, down_dx, every = (
        ops(cfg.replace(cublas_gemms=value)) for value in ("none", "down_dx", "all")
    )
    assert not any(op.cublas for op in plain)
    assert {op.name.split(": ")[1] for op in down_dx if op.cublas} == {
        "down dy W^T 0 (cuBLAS)",
        "down dy W^T 1 (cuBLAS)",
    }
    assert not any("down dy W^T" in op.name and not op.cublas for op in down_dx)
    assert any(op.name.endswith("input GEMM 1") and not op.cublas for op in down_dx)
    # every step GEMM moved: the step's own GEMM FLOPs all cuBLAS's (the chunk-wide ATen
    # GEMMs, not step ones, keep theirs)
    step = ("sequential forward", "sequential backward")
    triton_gemm_flops = sum(
        op.flops for op in plain if op.phase in step and op.cost is not None and op.cost.in_flight
    )
    assert gemm_flops([op for op in every if op.phase in step], True) == triton_gemm_flops
    assert not any(
        op.phase in step and op.cost is not None and op.cost.in_flight for op in every
    )  # no Triton GEMM left in the steps
    assert gpu_model.main(["tiny", "--batch", "2", "--seq-len", "8",
                           "--engine", "cublas_gemms=all"]) == 0  # fmt: skip
    assert "cuBLAS at the step GEMMs 70% of the copy (est." in capsys.readouterr().out
    assert gpu_model.main(["tiny", "--engine", "cublas_gemms=down"]) == 0
    capsys.readouterr()
    assert gpu_model.main(["tiny", "--engine", "cublas_gemms=downward"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown projection 'downward'" in err


SWEEP = """\
name: priced
seeds: [0, 1, 2]
data: {remote: /tmp/none, seq_len: 64}
checkpoint_root: /tmp/priced
wandb: {project: p}
hardware: {gpu: %s, mfu: %s}
defaults: {tokens: 4096, global_batch_size: 4, lr: 1.0e-3, warmup_steps: 1}
models:
  - {config: tiny}
"""


def test_sweep_plan_prices_with_the_predicted_mfu_unless_a_measured_one_is_given(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(SWEEP % ("H200", "predicted"))
    sweep = load_sweep(path)
    predicted = sweep.hardware["predicted_mfu"]["tiny"]
    assert 0 < predicted < 1
    run = sweep.runs[0]
    assert run.gpu_hours == pytest.approx(run.flops / (989e12 * predicted) / 3600)
    assert "MFU predicted by gpn_scale.accounting.gpu_model" in format_plan(sweep)
    path.write_text(SWEEP % ("H200", 0.25))
    run = load_sweep(path).runs[0]
    assert run.gpu_hours == pytest.approx(run.flops / (989e12 * 0.25) / 3600)
    path.write_text(SWEEP % ("B200", "predicted"))
    with pytest.raises(
        SweepError,
        match=textwrap.dedent(
            r"hardware.gpu: 'B200' has no launch accounting .* give a measured hardware.mfu"
        ),
    ):
        load_sweep(path)


def test_sweep_plan_prices_a_tp_size_with_the_predicted_tp_speed_up(tmp_path):
    """A size with `overrides: [parallel.tp=2]`: its predicted MFU is the tp = 1 figure times
    accounting/tp_model.py's speed-up (each GPU does the same FLOPs, in the predicted time)."""
    from gpn_scale.accounting import tp_model
    from gpn_scale.models.gpn import load_model_config

    path = tmp_path / "s.yaml"
    path.write_text(
        SWEEP.replace("{config: tiny}", "{config: tiny, overrides: [parallel.tp=2]}")
        % ("H200", "predicted")
    )
    sweep = load_sweep(path)
    got = sweep.hardware["predicted_mfu"]["tiny"]
    cfg = load_model_config("tiny")
    rows = {r.tp: r for r in tp_model.tp_table(cfg, 16, 64, "h200")}
    speed_up = rows[1].step_seconds["nccl"] / rows[2].step_seconds["nccl"]
    assert got == pytest.approx(gpu_model.predicted_mfu(cfg, 16, 64, "h200") * speed_up)
    assert speed_up != pytest.approx(1.0)
    run = sweep.runs[0]
    assert run.gpu_hours == pytest.approx(run.flops / (989e12 * got) / 3600)
    path.write_text(
        SWEEP.replace("{config: tiny}", "{config: tiny, overrides: [parallel.tp=16]}")
        % ("H200", "predicted")
    )
    with pytest.raises(SweepError, match=r"parallel\.tp=16"):
        load_sweep(path)


# ------------------------------------------------------- compiled kernels in the price
def _gemm(cost_kw: dict, name: str = "reverse step: input dy W^T 0") -> gpu_model.Op:
    from gpn_scale.accounting.kernel_costs import KernelCost

    kw = dict(kernel="linear_kernel", programs=156, blocks_per_sm=9, threads=128,
              spill_bytes=0, in_flight=16_384, host_s=16e-6, grid=(1, 39, 4),
              l2_bytes=0, m_blocks=1)  # fmt: skip
    kw.update(cost_kw)
    return gpu_model.Op(name, "sequential backward", 146_000_000, 0, True, cost=KernelCost(**kw))


def _seconds(op: gpu_model.Op, graphs: bool = True) -> float:
    acc = gpu_model.Accounting("x", 16, 64, 64, 1)
    acc.probes[64] = [op]
    return gpu_model.predict(acc, gpu_model.GPUS["h200"], graphs=graphs).seconds


def test_a_gemm_streams_its_weight_at_the_share_its_unique_bytes_in_flight_cover():
    """Little's law: copy bandwidth x latency bytes must be in flight; 156 programs with 16 KB
    of weight tiles each keep 2.5 MB, ~0.58 of the 4.3 MB an H200 needs; row blocks reading
    the same tile count once; the L2 -> SM traffic of the A operand bounds it where larger."""
    h200 = gpu_model.GPUS["h200"]
    need = h200.copy_bytes_per_s * h200.latency_s
    share = 156 * 16_384 / need
    base = _seconds(_gemm({}))
    expected = 146e6 / (h200.copy_bytes_per_s * share) + h200.latency_s + gpu_model.GRAPH_GAP_S
    assert base == pytest.approx(expected)
    # enough in flight: the copy bandwidth
    full = _seconds(_gemm(dict(in_flight=65_536)))
    assert full == pytest.approx(146e6 / h200.copy_bytes_per_s + h200.latency_s + 1.3e-6)
    # two row blocks read each weight tile: half the unique bytes in flight, twice the time
    shared = _seconds(_gemm(dict(m_blocks=2)))
    fixed = h200.latency_s + gpu_model.GRAPH_GAP_S
    assert shared - fixed == pytest.approx(2 * (base - fixed))
    # the float32 A re-read by every column tile: the L2 -> SM traffic bounds it
    l2 = 4 * 146e6
    assert _seconds(_gemm(dict(in_flight=65_536, l2_bytes=int(l2)))) == pytest.approx(
        l2 / h200.l2_bytes_per_s + h200.latency_s + 1.3e-6
    )
    # spill traffic is bytes too; eager: at least the host's binding; graphed: not
    assert _seconds(_gemm(dict(spill_bytes=20_000))) > 2 * base
    small = _gemm(dict(host_s=85e-6), name="reverse step: row backward")
    small.bytes = 1000
    assert _seconds(small, graphs=False) == pytest.approx(85e-6 + gpu_model.LAUNCHER_S)
    assert _seconds(small, graphs=True) < 10e-6


def test_other_kernels_wait_their_round_trips_per_wave_and_issue_between_them():
    """Each program: its round trips x the loaded latency, plus its instructions at one per
    dependent-issue latency (few warps cannot hide it); programs placed on the SMs' resident
    slots; plus the kernel's bytes."""
    from gpn_scale.accounting.kernel_costs import KernelCost

    h200 = gpu_model.GPUS["h200"]

    def op(programs, trips, issued=(), blocks=1, nbytes=0):
        cost = KernelCost("memory_backward_kernel", programs, blocks, 256, 0, 0, 5e-6,
                          grid=(programs // len(trips), len(trips)), trips=trips,
                          issued=issued)  # fmt: skip
        return gpu_model.Op("reverse step: memory/FFN backward 0", "sequential backward",
                            nbytes, 0, True, cost=cost)  # fmt: skip

    one_wave = _seconds(op(132, (40,)))
    assert one_wave == pytest.approx(40 * h200.latency_s + gpu_model.GRAPH_GAP_S)
    # 7.3 waves of (40 round trips): 8 waves, the last partly filled
    assert _seconds(op(960, (40,))) == pytest.approx(8 * 40 * h200.latency_s + 1.3e-6)
    # two resident programs per SM: half the waves
    assert _seconds(op(960, (40,), blocks=2)) == pytest.approx(4 * 40e-6 + 1.3e-6)
    # 8 warps issuing 60,000 warp-instructions: 7,500 each, one per 4 cycles at 1.98 GHz
    issue = 7_500 * 4 / h200.sm_clock_hz
    assert _seconds(op(132, (40,), issued=(60_000,))) == pytest.approx(40e-6 + issue + 1.3e-6)
    # classes along grid axis 1 (heads, then short FFN programs)
    mixed = _seconds(op(132 * 2, (40, 2)))
    assert 40e-6 < mixed < 45e-6
    assert _seconds(op(132, (40,), nbytes=int(4.3e6))) == pytest.approx(
        40e-6 + 4.3e6 / h200.copy_bytes_per_s + 1.3e-6
    )


def test_a_pipelined_loop_iterates_no_faster_than_a_round_trip_over_its_stages_ahead():
    """The walk counts a software-pipelined loop's later iterations' loads as ready; that
    holds while an iteration takes a round trip over the stages - 1 in flight. A body that
    issues faster waits the difference, each of those iterations; a slower one does not."""
    from gpn_scale.accounting.kernel_costs import KernelCost

    h200 = gpu_model.GPUS["h200"]

    def seconds(body: int, stages: int) -> float:
        # one program of 8 warps: 10 trips, 15 pipelined iterations of `body` instructions
        cost = KernelCost("memory_backward_kernel", 132, 1, 256, 0, 0, 5e-6, grid=(132, 1),
                          trips=(10,), issued=(8 * 15 * body,),
                          pipelined=(((15.0, body, stages),),))  # fmt: skip
        return _seconds(gpu_model.Op("reverse step: memory/FFN backward 0",
                                     "sequential backward", 0, 0, True, cost=cost))  # fmt: skip

    per_instruction = 4 / h200.sm_clock_hz  # one warp's dependent issue
    fast = 100  # 0.2 us an iteration: waits the rest of a round trip
    expected = 10e-6 + 15 * fast * per_instruction + 15 * (1e-6 - fast * per_instruction)
    assert seconds(fast, 2) == pytest.approx(expected + 1.3e-6)
    # two iterations in flight: half a round trip each
    wait3 = 15 * (0.5e-6 - fast * per_instruction)
    assert seconds(fast, 3) == pytest.approx(10e-6 + 15 * fast * per_instruction + wait3 + 1.3e-6)
    slow = 1_000  # 2 us an iteration: its loads are there when it starts
    assert seconds(slow, 2) == pytest.approx(10e-6 + 15 * slow * per_instruction + 1.3e-6)


def test_transformer_baseline_counts_its_gemm_flops_exactly_and_flash_attention_per_layer():
    """The Transformer++ priced beside the GPN: its dry step's matmul FLOPs are exactly the
    family's 6 x (weights' MACs) per token, and each layer's attention is one flash forward
    and one backward kernel (not the T x T math form meta tensors decompose it into)."""
    from gpn_scale.accounting.baseline_model import transformer_step_ops
    from gpn_scale.models.registry import load_model_config

    spec, cfg = load_model_config("transformer_pp_tiny")
    B, T = 2, 16
    ops = transformer_step_ops(cfg, B, T)
    attention = [op for op in ops if op.name.startswith("flash attention")]
    assert sorted({op.name for op in attention}) == [
        "flash attention backward",
        "flash attention forward",
    ]
    assert len(attention) == 2 * cfg.n_layers
    d, L = cfg.d_model, cfg.n_layers
    fwd = [op for op in attention if op.name.endswith("forward")][0]
    assert fwd.flops == 2 * B * T * T * d  # QK^T and PV over the causal half
    gemm = sum(op.flops for op in ops if op.name.rstrip("_") in ("mm", "addmm", "bmm", "baddbmm"))
    head = d * cfg.vocab_size
    assert gemm == 6 * (L * (4 * d * d + 3 * d * cfg.d_ffn) + head) * B * T
    assert not any(op.bytes >= B * cfg.n_heads * T * T * 2 for op in ops if op.name == "bmm")
    baseline = gpu_model.Baseline("transformer_pp_tiny", ops, B, T, spec.flops_per_token(cfg, T))
    assert baseline.tokens_per_s(gpu_model.GPUS["h200"]) > 0


class _DtypeLog(TorchDispatchMode):
    """Every ATen op run: (name, its tensor arguments' dtypes, its results' dtypes)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))

        def dtypes(x) -> tuple:
            items = x if isinstance(x, (list, tuple)) else [x]
            return tuple(str(t.dtype) for t in items if isinstance(t, torch.Tensor))

        ins = tuple(d for a in args for d in dtypes(a))
        self.rows.append((func.overloadpacket.__name__, ins, dtypes(out)))
        return out


def test_the_transformer_baseline_runs_in_the_dtypes_autocast_gives_it():
    """autocast knows no meta device, so the accounting makes autocast's casts itself
    (`baseline_model.autocast_emulated`). On CPU tensors, beside a real bf16 autocast: the
    forward runs the same ops in the same dtypes in the same order; the whole step the same
    ops (the backward's independent branches may run in another order); and the loss and
    every gradient are bitwise equal."""
    from gpn_scale.accounting.baseline_model import autocast_emulated
    from gpn_scale.models.registry import load_model_config

    _, cfg = load_model_config("transformer_pp_tiny")
    torch.manual_seed(0)
    model = family_of(cfg).build(cfg)  # float32 parameters, as the device check's
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))

    def step(autocast) -> tuple[list, list, Tensor, list[Tensor]]:
        model.zero_grad(set_to_none=True)
        with _DtypeLog() as log:
            with autocast:
                loss = model(tokens).loss
            forward = list(log.rows)
            loss.backward()
        return forward, log.rows, loss.detach(), [p.grad for p in model.parameters()]

    fwd, whole, loss, grads = step(torch.autocast("cpu", dtype=torch.bfloat16))
    fwd_e, whole_e, loss_e, grads_e = step(autocast_emulated(torch.bfloat16))
    assert any(row[0] == "mm" and row[1] == ("torch.bfloat16",) * 2 for row in fwd)
    assert fwd_e == fwd
    assert Counter(whole_e) == Counter(whole)
    assert torch.equal(loss_e, loss)
    assert all(torch.equal(a, b) for a, b in zip(grads_e, grads, strict=True))


def test_the_transformer_baseline_is_recorded_as_the_device_check_trains_it():
    """The Transformer++ step the accounting prices: float32 parameters under bf16 autocast
    on the CUDA path, as bench/gpu_throughput trains it. Its matmuls read bf16 (the first
    projection: 2 bytes an element), the float32 residual stream's norm is cast to bf16 before
    them, the head loss's softmax is our Triton kernel (as on CUDA) and not the PyTorch form's
    ops; and the model priced beside a GPN by default is the one the device check trains
    beside it."""
    from gpn_scale.accounting.baseline_model import fused, transformer_step_ops
    from gpn_scale.bench import gpu_throughput
    from gpn_scale.models.registry import load_model_config

    _, cfg = load_model_config("transformer_pp_tiny")
    B, T, d = 2, 16, cfg.d_model
    ops = transformer_step_ops(cfg, B, T)
    names = [op.name for op in ops]
    first_mm = ops[names.index("mm")]
    assert first_mm.bytes == 2 * (B * T * d + d * d + B * T * d)  # bf16 x, W and q
    assert any(op.name == "_to_copy" and op.bytes == 6 * B * T * d for op in ops)  # fp32 -> bf16
    xent = [op for op in ops if op.name == "softmax cross-entropy"]
    assert len(xent) == 1 and xent[0].triton
    assert xent[0] in fused(ops)  # compiled, it stays a kernel of its own
    assert not {"amax", "exp_", "log_softmax"} & set(names)
    # its place among the ATen ops: after the head block's logits, before their gradient's GEMM
    at = names.index("softmax cross-entropy")
    assert ops[at - 1].flops == 2 * B * T * d * cfg.vocab_size
    _, gpn = load_model_config("gpn_m_130m")
    assert gpu_model.baseline_for(gpn).name == gpu_throughput.transformer_candidate(gpn, T).config
    # a GPN too small for any Transformer++ of its width: one line, naming the way out
    with pytest.raises(ConfigError, match=r"--baseline auto: no Transformer\+\+ of width 64 .*"
                       r"--baseline none$"):  # fmt: skip
        gpu_model.baseline_for(tiny_config(d_emb=64))


def test_a_gemm_grid_pays_for_its_partial_last_wave_and_its_most_loaded_sm():
    h200 = gpu_model.GPUS["h200"]
    fixed = h200.latency_s + gpu_model.GRAPH_GAP_S
    # one resident program per SM: 133 programs are a full wave and one alone, which keeps
    # one program's tiles in flight (far below bandwidth x latency)
    whole = _seconds(_gemm(dict(programs=132, blocks_per_sm=1, in_flight=65_536))) - fixed
    tail = _seconds(_gemm(dict(programs=133, blocks_per_sm=1, in_flight=65_536))) - fixed
    share = 65_536 / (h200.copy_bytes_per_s * h200.latency_s)
    alone = 146e6 / 133 / (h200.copy_bytes_per_s * share)
    assert tail == pytest.approx(whole * 132 / 133 + alone)
    # 264 programs over 132 SMs: two programs' tiles through one SM's L2 port
    l2 = 132 * 2 * 1_000_000
    got = _seconds(_gemm(dict(programs=264, in_flight=65_536, l2_bytes=l2))) - fixed
    one_sm = 2 * 1_000_000 / h200.l2_one_sm_bytes_per_s
    all_sms = l2 / h200.l2_bytes_per_s
    assert got == pytest.approx(max(one_sm, all_sms, 146e6 / h200.copy_bytes_per_s))


def test_a_programs_instructions_leave_out_the_branch_arms_it_skips():
    """gpu_compile_ptx.line_instructions' rows ([count, *lines]) against the arms a program
    skips (round_trips.Program.skipped): an instruction on a skipped line, or inlined from a
    call on one, is not the program's; facts of another file, or without lines, skip none."""
    from gpn_scale.accounting import kernel_costs

    path = __file__
    rows = [[5, 10], [3, 10, 20, 30], [7, 99, 50], [2, 60]]
    assert kernel_costs.skipped_instructions((path, rows), ((path, 20, 25),)) == 3
    assert kernel_costs.skipped_instructions((path, rows), ((path, 50, 60),)) == 9
    assert kernel_costs.skipped_instructions((path, rows), (("/elsewhere.py", 1, 100),)) == 0
    assert kernel_costs.skipped_instructions(("", []), ((path, 1, 100),)) == 0
    # outside loops 100 - 10 - 30 skipped, the loop's 10 four times
    assert kernel_costs.issued_instructions(100, [10], (4.0,), skipped=30) == 100.0
    assert kernel_costs.issued_instructions(100, [10], (), skipped=30) == 0.0  # unmatched loops
