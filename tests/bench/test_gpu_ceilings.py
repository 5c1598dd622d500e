"""gpn_scale/bench/gpu_ceilings.py on CPU: every code path at scale "tiny" (the Triton kernels
in Triton's interpreter), the pointer chase's permutation as a pure function, and the two
kernels' results (not their timings: no figure here means anything)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gpn_scale.accounting.ceilings import MEASURED_KEYS  # what the accounting reads of a run
from gpn_scale.bench import gpu_ceilings as gc
from gpn_scale.ops.gpn_step.options import PROJECTIONS

CPU = torch.device("cpu")
DETAILS = ("latency_hbm_idle_s", "latency_l2_s", "latency_hbm_loaded_s")


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read when the kernels are first built (gc._kernels), i.e. inside the test, not at import.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _walk(nxt: torch.Tensor, start: int, steps: int) -> list[int]:
    path = [start]
    for _ in range(steps):
        path.append(int(nxt[path[-1]]))
    return path


@pytest.mark.parametrize("n", [1, 2, 5, 1000])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_permutation_is_one_cycle_through_every_slot(n, seed):
    nxt = gc.cyclic_permutation(n, torch.Generator().manual_seed(seed))
    path = _walk(nxt, 0, n)
    assert sorted(path[:n]) == list(range(n)), "a slot missed or visited twice in one cycle"
    assert path[n] == 0, "the chase does not come back to its start after n steps"


def test_the_chase_buffer_puts_each_slot_on_its_own_line():
    nxt = gc.cyclic_permutation(9, torch.Generator().manual_seed(3))
    buf = gc.chase_buffer(nxt, stride=32)
    assert buf.dtype == torch.int32 and len(buf) == 9 * 32
    assert torch.equal(buf[::32].long(), nxt * 32)
    assert bool((buf.view(9, 32)[:, 1:] == -1).all())


def test_the_chase_kernel_follows_the_cycle(interpreter):
    n, stride = 50, 32
    nxt = gc.cyclic_permutation(n, torch.Generator().manual_seed(4))
    buf = gc.chase_buffer(nxt, stride)
    path = _walk(nxt, 0, n)
    cursor = torch.zeros(1, dtype=torch.int32)
    gc.chase(buf, cursor, 7)
    assert int(cursor) == path[7] * stride
    gc.chase(buf, cursor, n - 7)  # goes on from where it stopped: round to the start
    assert int(cursor) == 0


@pytest.mark.parametrize("slice_blocks", [1, 3])  # the prefetch loop run none / twice
def test_the_l2_read_kernel_sums_every_slice_once_per_repeat(interpreter, slice_blocks):
    programs, block, repeats = 3, 64, 4
    g = torch.Generator().manual_seed(5)
    # Small integers: every float32 partial sum is exact, so equality is the check.
    x = torch.randint(1, 9, (programs * slice_blocks * block,), generator=g).float()
    out = gc.l2_read_sum(x, programs, repeats, block)
    assert out.double().sum().item() == x.double().sum().item() * repeats
    slices = x.double().view(programs, -1).sum(1)
    expected = [sum(slices[(p + r) % programs] for r in range(repeats)) for p in range(programs)]
    assert out.double().tolist() == [float(e) for e in expected]


def test_the_step_gemms_are_the_130m_shapes():
    rows = gc.step_gemms()
    assert ("input", 64, 2496, 27358, False) in rows
    assert ("input_dx", 128, 27358, 2496, True) in rows
    assert ("down", 64, 10496, 2496, False) in rows
    assert ("down_dx", 128, 2496, 10496, True) in rows
    assert ("fuse_gate", 128, 2496, 2496, False) in rows
    assert ("fuse_gate_dx", 128, 2496, 2496, True) in rows
    # every projection engine.cublas_gemms can send through cuBLAS is timed there
    assert {r[0] for r in rows[:-1]} == set(PROJECTIONS)
    assert rows[-1] == ("chunk-wide input", 64 * 64, 2496, 27358, False)
    assert len(rows) == 2 * 6 + 1


def _assert_positive(value, name):
    assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)


def test_measure_ceilings_tiny_runs_every_path_on_cpu(interpreter):
    result = gc.measure_ceilings(CPU, "tiny")
    for key in (*MEASURED_KEYS, *DETAILS):
        _assert_positive(result[key], key)
    assert result["latency_s"] == result["latency_hbm_loaded_s"]
    assert len(result["gemms"]) == len(gc.step_gemms(gc.SIZES["tiny"].step))
    for row in result["gemms"]:
        assert len(row["shape"]) == 3 and row["role"]
        for key in ("seconds", "tflops", "gbytes_per_s"):
            _assert_positive(row[key], f"{row['role']} {key}")
    assert result["sm_count"] is None and result["l2_bytes"] is None
    assert isinstance(result["device_name"], str)
    json.dumps(result, allow_nan=False)


def test_measure_ceilings_refuses_bad_input(monkeypatch):
    with pytest.raises(ValueError, match="unknown scale"):
        gc.measure_ceilings(CPU, "huge")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        gc.measure_ceilings(CPU, "tiny")


def test_the_cli_writes_ceilings_json_and_a_table(interpreter, tmp_path, capsys):
    out = tmp_path / "run"
    assert gc.main(["--out", str(out), "--device", "cpu", "--scale", "tiny"]) == 0
    written = json.loads((out / "ceilings.json").read_text())
    assert set(MEASURED_KEYS) <= set(written)
    table = capsys.readouterr().out
    assert "| copy_bytes_per_s |" in table and "| fuse_gate |" in table


@pytest.mark.parametrize(
    "args, says",
    [
        (["--scale", "huge"], "unknown --scale 'huge'"),
        (["--scale", "full"], "use --scale tiny"),
        (["--out-is-a-file"], "is a file"),
        (["--device", "tpu9"], "unknown --device 'tpu9'"),
    ],
)
def test_the_cli_names_bad_input_in_one_line(tmp_path, capsys, args, says):
    target = tmp_path / "out"
    if args == ["--out-is-a-file"]:
        target.write_text("")
        args = ["--scale", "tiny"]
    assert gc.main(["--out", str(target), "--device", "cpu", *args]) == gc.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
