"""The engine benchmark's roofline, and the benchmark build of the step kernels that leaves the
sequential phases' matmuls out (the roofline's "rest" column)."""

from __future__ import annotations

import pytest
import torch

from gpn_scale.bench import engine as engine_bench
from gpn_scale.ops.execution import execution
from gpn_scale.ops.gpn_step import step_kernels
from gpn_scale.ops.gpn_step.registry import kernels_for
from gpn_scale.ops.gpn_step.step_kernels import ENV_VAR
from gpn_scale.testing.models import perturbed_model, tiny_config

# Every weight (and the one bias added inside a matmul call) that the sequential phases'
# matmuls read: with these zero, leaving the matmuls out changes nothing.
STEP_MATMUL_WEIGHTS = (
    "fuse_gate.proj.weight",
    "write.key.weight",
    "write.key.bias",
    "write.value.weight",
    "write.beta.weight",
    "write.decay.weight",
    "ffn.w1.weight",
    "ffn.w2.weight",
    "gate.proj.weight",
    "read.query.weight",
    "read.gate.weight",
    "read.out.weight",
)

pytestmark = pytest.mark.slow  # builds a second copy of the kernels (~40 s, once)


@pytest.fixture
def without_matmuls(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    if kernels_for(torch.device("cpu")) is None:
        pytest.fail("the fused step kernels did not build")
    return step_kernels.benchmark_build(step_kernels.WITHOUT_STEP_MATMULS)


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    out = model(tokens, return_state=True)
    out.loss.backward()
    return out.loss.detach(), out.state.s.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("layers", [1, 2])
def test_build_without_step_matmuls_leaves_out_exactly_the_matmuls(without_matmuls, layers):
    model = perturbed_model(tiny_config(chunk_size=4, n_layers=layers), torch.float64)
    tokens = torch.randint(0, 37, (3, 10), generator=torch.Generator().manual_seed(1))
    normal = _loss_and_grads(model, tokens)
    with execution(step_kernels=without_matmuls):
        assert kernels_for(torch.device("cpu")) is without_matmuls
        skipped = _loss_and_grads(model, tokens)
    assert kernels_for(torch.device("cpu")) is not without_matmuls  # the override ends
    assert not torch.equal(normal[0], skipped[0])  # it does leave them out

    with torch.no_grad():  # ... and nothing else: with those weights zero, the two agree
        for name, p in model.named_parameters():
            if name.endswith(STEP_MATMUL_WEIGHTS):
                p.zero_()
    normal = _loss_and_grads(model, tokens)
    with execution(step_kernels=without_matmuls):
        skipped = _loss_and_grads(model, tokens)
    # Not bitwise: MKL may round differently with other buffer alignments between the runs.
    exact = dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(skipped[0], normal[0], **exact)
    torch.testing.assert_close(skipped[1], normal[1], **exact)
    for got, want in zip(skipped[2], normal[2]):
        torch.testing.assert_close(got, want, **exact)


def test_roofline_splits_the_sequential_phases(without_matmuls):
    rows = engine_bench.bench_roofline(1, shape=("tiny", 2, 16))
    by_phase = {r["phase"]: r for r in rows}
    assert list(by_phase) == [
        "sequential forward",
        "sequential backward",
        "parallel recompute",
        "memory carry backward",
        "weight gradients",
        "decode",
    ]
    for name, row in by_phase.items():
        assert row["seconds"] > 0 and row["bare_matmuls"] > 0
        if name.startswith("sequential"):
            assert row["other_work"] > 0
            assert row["ratio_of_sum"] == pytest.approx(
                (row["bare_matmuls"] + row["other_work"]) / row["bare_matmuls"]
            )
        else:
            assert row["other_work"] is None and row["ratio_of_sum"] is None


def test_machine_probe_measures_latency_and_streaming():
    from gpn_scale.bench import machine

    curve = machine.latency_curve((0.25, 4.0))
    assert [row["megabytes"] for row in curve] == [0.25, 4.0]
    assert all(row["ns"] > 0 for row in curve)
    rows = machine.streaming((1.0,), 2)
    assert len(rows) == 1 and len(rows[0]["gbps"]) == 2 and all(r > 0 for r in rows[0]["gbps"])
    assert machine.main(["--sizes", "0.5"]) == 0


def test_machine_probe_without_a_compiler_is_one_line(monkeypatch, tmp_path, capsys):
    from gpn_scale.bench import machine

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    machine._probe.cache_clear()
    try:
        assert machine.main(["--sizes", "0.5"]) == 2
    finally:
        machine._probe.cache_clear()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"gpn_scale.bench.machine: machine probe: no C++ compiler '{tmp_path / 'no-such-c++'}' "
        "on PATH; install g++ or set CXX"
    ]
    assert not (tmp_path / "machine_probe").exists() or not any(
        (tmp_path / "machine_probe").iterdir()
    )
