"""gpn_scale/bench/gpu_placement.py on CPU: the probe kernel under Triton's interpreter (its
programs on emulated SMs), and the reading of what a grid held as a placement, on SM lists
written here for each answer a GPU could give."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from gpn_scale.accounting import device_runs
from gpn_scale.accounting.step_model import PACKED, SPREAD
from gpn_scale.bench import gpu_placement as gp

CPU = torch.device("cpu")


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read when the kernel is first built (gp._kernels), i.e. inside the test.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize(
    ("programs", "held", "fits"),
    [
        (33, 33, SPREAD),  # one a SM
        (33, 9, PACKED),  # four a SM: ceil(33 / 4)
        (33, 31, SPREAD),  # a few doubled up: still nearer spread than a quarter of the gap
        (33, 21, gp.NEITHER),  # half way
        (264, 132, SPREAD),  # two a SM on every SM
        (264, 66, PACKED),
        (528, 132, None),  # the whole GPU: both placements hold every SM
        (1, 1, None),
    ],
)
def test_a_grid_shows_the_placement_whose_sm_count_it_held(programs, held, fits):
    assert gp.placement_of(programs, held, sm_count=132, per_sm=4) == fits


def _grid(programs: int, sms: list[int], start: list[int] | None = None, end=None) -> dict:
    start = start or [0] * programs
    end = end or [1] * programs
    return gp._grid_row(programs, {"sm": sms, "start": start, "end": end}, sm_count=8)


def test_grid_rows_count_the_sms_held_and_whether_all_ran_at_once():
    packed = _grid(8, [0, 0, 0, 0, 1, 1, 1, 1])
    assert (packed["sms_held"], packed["most_on_one_sm"], packed["fits"]) == (2, 4, PACKED)
    assert (packed[PACKED], packed[SPREAD]) == (2, 8)
    spread = _grid(16, [i % 8 for i in range(16)])
    assert (spread["sms_held"], spread["fits"]) == (8, SPREAD)
    # the last program started after the first had stopped: not all resident at once
    late = _grid(4, [0, 1, 2, 3], start=[0, 0, 0, 5], end=[4, 6, 6, 9])
    assert not late["co_resident"]
    assert gp.verdict([packed, late]) is None  # a grid that did not fit says nothing


def test_the_verdict_is_what_the_informative_grids_agree_on():
    spread = _grid(4, [0, 1, 2, 3])
    packed = _grid(8, [0, 0, 0, 0, 1, 1, 1, 1])
    whole = _grid(32, [i % 8 for i in range(32)])  # 4 a SM on every SM: says nothing
    assert whole["fits"] is None
    assert gp.verdict([spread, whole]) == SPREAD
    assert gp.verdict([packed, whole]) == PACKED
    assert gp.verdict([spread, packed]) == gp.MIXED
    assert gp.verdict([whole]) is None


def test_the_probe_records_each_programs_sm_in_the_interpreter(interpreter):
    got = gp.probe(11, 0, CPU)
    assert got["sm"].tolist() == [i % gp.EMULATED_SMS for i in range(11)]
    assert got["start"].dtype == torch.int64 and not got["end"].any()


def test_measured_placement_is_recorded_and_the_accounting_ignores_an_emulated_one(
    interpreter, tmp_path
):
    result = gp.measure_placement(CPU)
    programs = [g["programs"] for g in result["grids"]]
    assert programs == [round(gp.EMULATED_SMS * s) for s in gp.GRID_SHARES]
    # program i on SM i mod 8: one a SM, as a spreading scheduler places them
    assert result["placement"] == SPREAD and result["emulated"]
    assert result["beside"]["programs"] == gp.EMULATED_SMS
    lines = "\n".join(gp.markdown(result))
    assert "Block scheduler placement" in lines and "| 2 | 2 | 1 | 2 | 1 | yes | spread |" in lines
    # a device run whose probe ran on emulated SMs measured nothing
    assert device_runs.placement({"placement": result}) is None
    assert device_runs.placement({"placement": {**result, "emulated": False}}) == SPREAD
    assert device_runs.placement({"placement": {"error": "RuntimeError: x"}}) is None
    assert device_runs.placement({}) is None


def test_the_command_writes_placement_json_and_refuses_a_device_it_cannot_probe(
    interpreter, tmp_path, capsys
):
    assert gp.main(["--out", str(tmp_path), "--device", "cpu"]) == 0
    saved = json.loads((tmp_path / "placement.json").read_text())
    assert saved["placement"] == SPREAD and len(saved["grids"]) == len(gp.GRID_SHARES)
    assert gp.main(["--out", str(tmp_path / "x"), "--device", "mps"]) == gp.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.strip() == "gpu_placement: --device mps: use cuda or cpu"
    assert not (tmp_path / "x").exists()


def test_green_context_runner_speaks_both_torch_apis(monkeypatch):
    """torch 2.11 (the GPU image's) creates a green context from positional arguments and
    pushes it as the current context; torch >= 2.12 takes keywords and gives it streams."""
    from torch.cuda import green_contexts

    calls = []

    class Older:
        @staticmethod
        def create(num_sms, device_id, /):
            calls.append(("create", num_sms, device_id))
            return Older()

        def set_context(self):
            calls.append("set")

        def pop_context(self):
            calls.append("pop")

    monkeypatch.setattr(green_contexts, "GreenContext", Older)
    with pytest.raises(RuntimeError, match="inside"):
        with gp.green_context_runner(32, 1):
            calls.append("work")
            raise RuntimeError("inside")
    assert calls == [("create", 32, 1), "set", "work", "pop"]  # popped however it ended

    calls.clear()
    stream = object()

    class Newer:
        @staticmethod
        def create(*, num_sms, device_id):
            calls.append(("create", num_sms, device_id))
            return Newer()

        def Stream(self):  # noqa: N802 - torch's name
            return stream

    def on_stream(s):
        calls.append(("stream", s))
        return contextlib.nullcontext()

    monkeypatch.setattr(green_contexts, "GreenContext", Newer)
    monkeypatch.setattr(torch.cuda, "stream", on_stream)
    with gp.green_context_runner(16, 0):
        calls.append("work")
    assert calls == [("create", 16, 0), ("stream", stream), "work"]


def test_the_green_context_probe_needs_cuda(interpreter):
    result = gp.measure_placement(CPU)
    assert result["green_context"] == {"skipped": "needs CUDA"}
    assert "Green context: needs CUDA." in "\n".join(gp.markdown(result))
