"""The memory kernels leaving SMs to the side streams (`engine.side_work_sm_share`): their
programs on the reserved SMs leave at once and the others take the grid's items from a
counter (`triton_kernels.memory_backward_kernel`, `memory_forward_kernel`). Under the
interpreter program i stands on SM i mod 16 (`geometry.reserved_sms`): the gradients are
bit-identical to the plain grids' whichever programs leave, the grid's last program never
leaves, and each launch has its own counter. On the GPU the device check compares both
(bench/gpu_exactness.py) and times them (bench/gpu_throughput.py)."""

from __future__ import annotations

import pytest
import torch

from gpn_scale.accounting import gpu_compile
from gpn_scale.core.config import ConfigError
from gpn_scale.ops.gpn_step import cuda_reverse, geometry
from gpn_scale.ops.gpn_step import triton_kernels as tk
from gpn_scale.ops.gpn_step.options import EngineOptions
from gpn_scale.ops.gpn_step.registry import ENV_VAR
from gpn_scale.ops.launch import recording
from gpn_scale.testing.models import perturbed_model, tiny_config


def _grads(share: float, monkeypatch, overlap: bool = True) -> tuple[list, list, list]:
    """The cuda backend's loss and gradients (float64, interpreter), the memory backward
    launches, and the item counters the sweeps used."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    cfg = tiny_config(n_layers=2, chunk_size=4).replace(
        step_backend="cuda", cuda_graphs=False, overlap_backward=overlap, side_work_sm_share=share
    )
    model = perturbed_model(cfg, torch.float64)
    tokens = torch.randint(0, cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(5))
    queues = []
    made = cuda_reverse._side_work_queue

    def keep(*args):
        queue, reserve = made(*args)
        queues.append(queue)
        return queue, reserve

    monkeypatch.setattr(cuda_reverse, "_side_work_queue", keep)
    with recording(keep_args=True) as launches:
        loss = model(tokens).loss
        grads = torch.autograd.grad(loss, list(model.parameters()))
    kernels = (tk.memory_backward_kernel, tk.memory_forward_kernel)
    memory = [r for r in launches if r.kernel in kernels]
    return [loss, *grads], memory, queues


@pytest.mark.slow
@pytest.mark.parametrize("share", [0.25, 0.99], ids=["a quarter", "all but the last program"])
def test_the_queue_gives_the_plain_grids_gradients_bit_for_bit(share, monkeypatch):
    want, plain, _ = _grads(0.0, monkeypatch)
    got, queued, queues = _grads(share, monkeypatch)
    assert plain and all(r.meta.get("RESERVED_SMS", 0) == 0 for r in plain)
    reserved = int(geometry.INTERPRETER_SMS * share)
    assert queued and all(r.meta["RESERVED_SMS"] == reserved for r in queued)
    assert all(r.meta["EMULATED_SMS"] == geometry.INTERPRETER_SMS for r in queued)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert {r.kernel for r in queued} == {tk.memory_backward_kernel, tk.memory_forward_kernel}
    # Each step's and layer's backward launch had its own counter: every item claimed once,
    # and one claim past the end by each program that took items (at least one, at most all).
    items = queued[0].grid[0] * queued[0].grid[1]
    assert all(r.grid == queued[0].grid for r in queued)
    assert queues and all(q is not None for q in queues)
    for q in queues:
        counts = q[:, :, 0]
        assert ((counts > items) & (counts <= 2 * items)).all(), counts
        assert not q[:, :, 1:].any()


def test_nothing_is_reserved_without_the_side_stream_or_with_a_share_of_zero():
    assert geometry.reserved_sms(torch.zeros(1), 0.0) == {"RESERVED_SMS": 0, "EMULATED_SMS": 0}
    # a GPU (a dry run's meta tensors): the device's SMs, no emulation
    assert geometry.reserved_sms(torch.zeros(1, device="meta"), 0.25) == {
        "RESERVED_SMS": 33,
        "EMULATED_SMS": 0,
    }
    # each memory kernel leaves SMs only beside its own side stream
    for overrides, kernel in (
        ({"overlap_backward": False}, tk.memory_backward_kernel),
        ({"overlap_decode": False}, tk.memory_forward_kernel),
        ({"side_work_sm_share": 0.0}, tk.memory_backward_kernel),
        ({"side_work_sm_share": 0.0}, tk.memory_forward_kernel),
    ):
        case = gpu_compile.Case("testing_tiny", 3, dtype="bf16", overrides=tuple(overrides.items()))
        records = gpu_compile.record_launches(case, sm_count=132, arch=90)
        memory = [r for r in records if r.kernel is kernel]
        assert memory and all(r.meta.get("RESERVED_SMS", 0) == 0 for r in memory)


def test_a_dry_run_reserves_the_share_of_its_sms():
    case = gpu_compile.Case("testing_tiny", 3, dtype="bf16")
    records = gpu_compile.record_launches(case, sm_count=132, arch=90)
    kernels = (tk.memory_backward_kernel, tk.memory_forward_kernel)
    memory = [r for r in records if r.kernel in kernels]
    assert {r.kernel for r in memory} == set(kernels)
    assert all(r.meta["RESERVED_SMS"] == 33 for r in memory)
    assert all(r.meta["EMULATED_SMS"] == 0 for r in memory)


@pytest.mark.parametrize(
    ("version", "queued"),
    [((3, 6), (8, 5)), ((3, 7), (8, 5)), ((3, 8), (16, 4)), ((4, 0), (16, 4))],
)
def test_the_forward_queue_walks_fewer_rows_a_block_before_triton_3_8(version, queued, monkeypatch):
    """Triton 3.6 spills the memory forward's item queue at 16 rows of M0 a block (cuda_shared
    says why); there it takes 8, five stages deep, and the plain grid keeps 16 rows and four
    stages under every version. M0 read in bf16 takes 3 stages at either block."""
    monkeypatch.setattr(tk, "triton_version", lambda: version)
    for share, (rows, stages) in ((0.25, queued), (0.0, (16, 4))):
        for bf16_reads in (False, True):
            overrides = (("side_work_sm_share", share), ("bf16_memory_reads", bf16_reads))
            case = gpu_compile.Case("testing_tiny", 3, dtype="bf16", overrides=overrides)
            records = gpu_compile.record_launches(case, sm_count=132, arch=90)
            forward = [r for r in records if r.kernel is tk.memory_forward_kernel]
            assert forward and {r.meta["BLOCK_R"] for r in forward} == {rows}, (share, version)
            want = 3 if bf16_reads else stages
            assert {r.meta["STAGES"] for r in forward} == {want}, (share, version, bf16_reads)


@pytest.mark.parametrize(
    ("version", "apart"), [((3, 6), True), ((3, 7), True), ((3, 8), False), ((4, 0), False)]
)
def test_the_backward_queue_calls_its_item_apart_before_triton_3_8(version, apart, monkeypatch):
    """Triton 3.6 spills the memory backward's item queue with the item inlined (its index
    lanes held across the loop; triton_kernels.queued_item says why): there the queue calls
    the same program apart (noinline); 3.8 inlines it. The plain grid inlines it always."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a compiled JIT function: its noinline flag
    program = tk._memory_backward_program
    item = tk.queued_item(program, version)
    assert (item is not program) == apart
    assert item.fn is program.fn  # the same code, only called apart
    assert getattr(item, "noinline", False) == apart
    # the kernel's queue calls the choice for the Triton installed
    assert (tk._memory_backward_item is not program) == (tk.triton_version() < (3, 8))


@pytest.mark.parametrize("bad", [1.0, -0.1, "half", True])
def test_the_share_is_checked(bad):
    assert EngineOptions().side_work_sm_share == 0.25
    with pytest.raises(ConfigError, match=r"side_work_sm_share: expected a number in \[0, 1\)"):
        EngineOptions(side_work_sm_share=bad)


def test_the_accounting_prices_the_items_on_the_sms_the_launch_keeps():
    """A dry run's memory backward leaves 33 of 132 SMs: the accounting prices its programs
    on the other 99 (slower alone) and gives side work at least the 33 whole SMs."""
    from dataclasses import replace

    from gpn_scale.accounting import pricing, step_model
    from gpn_scale.models.gpn import load_model_config

    cfg = load_model_config("tiny")
    c = step_model.gpu_ceilings("h200")
    ops = {}
    for share in (0.0, 0.25):
        acc = step_model.account(cfg.replace(side_work_sm_share=share), 4, 32, "tiny")
        memory = [op for op in acc.ops if "memory/FFN backward" in op.name and op.cost]
        assert memory and all(op.cost.reserved_sms == int(132 * share) for op in memory)
        ops[share] = memory[0]
    left = ops[0.25]
    plain = replace(left, cost=replace(left.cost, reserved_sms=0))
    assert pricing.price(left, c, True).seconds >= pricing.price(plain, c, True).seconds
    wide = replace(left, cost=replace(left.cost, programs=10_000, grid=(10_000,)))
    gap = pricing.gap_s(wide)
    spare = step_model._spare([wide], wide.phase, c, lambda op: gap + 1.0)
    assert spare == pytest.approx(gap + 33 / 132)


def test_the_accountings_loop_order_takes_a_defaulted_constexpr_at_its_default():
    """A plain launch leaves RESERVED_SMS at its default (0): the queue's arm is dropped, and
    the item body's one d_value loop is the kernel's only loop (both arms' loops were counted
    before, and no instruction count could be matched to the compiled loops)."""
    from gpn_scale.accounting import round_trips

    plain = round_trips.loop_order(tk.memory_backward_kernel, {"WRITE": True, "MEMORY": True})
    assert len(plain) == 1 and plain[0][0] == "_memory_backward_program"
