"""The device-run format (accounting/device_runs.py) and the accounting held against it:
`gpu_model --against` reads a committed run back, prices the run's own kernels with the run's
ceilings, and the corrected accounting reproduces the 2026-12-04 H200 run's GPN+M steps."""

from __future__ import annotations

import json

import pytest

from gpn_scale.accounting import baseline_report, ceilings, device_runs, gpu_model, gpu_report

RUN = "2026-12-04-h200"


def test_the_committed_run_is_in_the_format_and_names_what_it_did_not_record():
    run = device_runs.resolve(RUN)
    blob = device_runs.read_results(run)
    rows = device_runs.model_rows(blob, "gpn_m_130m")
    assert [r["batch"] for r in rows] == [8, 16, 32, 64, 128]
    assert all(set(r) == {"batch", "tokens_per_s", "step_s", "mfu"} for r in rows)
    assert blob["summary"][device_runs.HEADLINE] is None  # no compiled baseline then
    assert blob["meta"]["commit"].startswith("90252f5")
    assert any("compiled Transformer++" in x for x in blob["meta"]["not_recorded"])
    facts = device_runs.kernel_facts(run, "gpn_m_130m", 64)
    backward = facts[("memory_backward_kernel", "memory/FFN backward 0")]
    assert backward["blocks_per_sm"] == 1 and backward["registers"] > 200
    kernels = json.loads((run / device_runs.KERNELS).read_text())
    assert kernels["triton"] == "3.6.0" and kernels["commit"] == blob["meta"]["commit"]


def test_corrected_accounting_predicts_the_measured_h200_steps_within_25_percent():
    """Issue 33's bar: 0.961 / 2.437 / 4.516 s at B = 16 / 64 / 128 (the accounting before
    this predicted 0.458 / 0.843 / -). Physical terms only (accounting/pricing.py)."""
    result = gpu_report.against("gpn_m_130m", RUN, batches=[16, 64, 128])
    steps = {s["batch"]: s for s in result["steps"]}
    assert sorted(steps) == [16, 64, 128]
    assert [steps[b]["measured_s"] for b in (16, 64, 128)] == [0.961, 2.437, 4.516]
    for s in steps.values():
        assert 0.75 <= s["predicted_s"] / s["measured_s"] <= 1.25, s
    # the launches that ran there, not this tree's (its kernels have changed since)
    assert result["priced"] == f"{RUN}/ops.json.gz"
    assert result["kernels"] == []  # that run kept no ledger


def test_against_sets_the_runs_transformer_rows_beside_the_accounting_of_them():
    """The ratio's denominator is held against the run too: the Transformer++ the device check
    trained beside gpn_m_130m (matched to its size: L15 d768 f1984, tied), per measured batch,
    priced with the run's ceilings; that run's step formed the whole logits, this tree's loss
    goes blockwise, and the table says the code changed (git, from the run's commit)."""
    result = gpu_report.against("gpn_m_130m", RUN, batches=[16, 64])["transformer"]
    assert result["model"] == "transformer++ L15 d768 f1984"
    rows = {r["batch"]: r for r in result["rows"]}
    assert sorted(rows) == [16, 64]
    assert [rows[b]["measured_s"] for b in (16, 64)] == [0.138, 0.527]
    assert all(r["model"] == result["model"] and r["predicted_s"] > 0 for r in rows.values())
    assert result["code_changed"] is True
    lines = "\n".join(baseline_report.table(result))
    assert "| transformer++ L15 d768 f1984 | 64 | " in lines and "changed since the run" in lines


def test_against_reads_a_run_folder_with_its_ceilings_and_ledger(tmp_path, capsys):
    """A run in the format, written here: its measured ceilings are priced with (and named
    as the source), its ledger rows compared role by role; --json is one object."""
    run = tmp_path / "2027-01-01-h200"
    run.mkdir()
    rows = [{"batch": 2, "tokens_per_s": 1000.0, "step_s": 0.016, "mfu": None}]
    blob = {
        "meta": {"device_name": "NVIDIA H200", "seq_len": 8, "cuda_graphs": True},
        "summary": {"tiny": {"config": "tiny", "rows": rows}, device_runs.HEADLINE: None},
        "ceilings": {"copy_bytes_per_s": 2.0e12, "latency_s": 2.0e-6},
        "ledger": {"rows": [{"config": "tiny", "batch": 2, "role": "row backward",
                             "s_per_step": 1e-3}]},
    }  # fmt: skip
    (run / device_runs.RESULTS).write_text(json.dumps(blob))
    assert gpu_model.main(["tiny", "--against", str(run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [s["batch"] for s in got["steps"]] == [2]
    assert got["steps"][0]["measured_s"] == 0.016 and got["steps"][0]["predicted_s"] > 0
    assert got["kernels"][0]["role"] == "row backward" and got["kernels"][0]["measured_s"] == 1e-3
    assert got["ceilings"]["latency_s"] == {"value": 2.0e-6, "source": "measured, 2027-01-01-h200"}
    assert got["transformer"]["rows"] == []  # a GPN too small to have one matched to it
    assert gpu_model.main(["tiny", "--against", str(run)]) == 0
    assert "| 2 |" in capsys.readouterr().out
    assert gpu_model.main(["gpn_m_130m", "--against", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no measured rows for gpn_m_130m" in err
    assert gpu_model.main(["tiny", "--against", str(tmp_path / "none")]) == 2
    assert "no results.json" in capsys.readouterr().err


def test_against_sets_the_engine_ab_rows_beside_the_shipped_ones(tmp_path, capsys):
    """The device check times the first config with each engine option of
    gpu_throughput.ENGINE_AB changed: `--against` reads those rows back, prices the changed
    options beside the shipped ones, and prices the side streams under both placements."""
    run = tmp_path / "2027-01-01-h200"
    run.mkdir()

    def rows(step_s):
        return [{"batch": 2, "tokens_per_s": 16 / step_s, "step_s": step_s, "mfu": None}]

    blob = {
        "meta": {"device_name": "NVIDIA H200", "seq_len": 8, "cuda_graphs": True,
                 "overlap_backward": True, "overlap_decode": True, "dependent_launch": True},
        "summary": {
            "tiny": {"config": "tiny", "rows": rows(0.016)},
            "tiny (overlap off)": {
                "config": "tiny engine.overlap_backward=false engine.overlap_decode=false",
                "rows": rows(0.020),
            },
            "tiny (dependent launch off)": {
                "config": "tiny engine.dependent_launch=false", "rows": rows(0.017)
            },
            "transformer++ (x)": {"config": "transformer++ L1", "rows": rows(0.01)},
            device_runs.HEADLINE: None,
        },
    }  # fmt: skip
    (run / device_runs.RESULTS).write_text(json.dumps(blob))
    result = gpu_report.against("tiny", str(run))
    ab = {r["label"]: r for r in result["engine_ab"]}
    assert set(ab) == {"overlap off", "dependent launch off"}
    overlap = ab["overlap off"]
    assert overlap["options"] == {"overlap_backward": False, "overlap_decode": False}
    assert overlap["measured_s"] == {"shipped": 0.016, "changed": 0.020}
    p = overlap["predicted_s"]
    # off hides nothing; spread programs leave side work less room than packed ones
    assert p["changed"] >= p["shipped, spread"] >= p["shipped, packed"] > 0
    assert ab["dependent launch off"]["options"] == {"dependent_launch": False}
    assert gpu_model.main(["tiny", "--against", str(run)]) == 0
    out = capsys.readouterr().out
    assert "| overlap off | 2 | 0.016 | 0.020 |" in out
    assert "| dependent launch off | 2 | 0.016 | 0.017 |" in out


def test_spread_sweep_programs_leave_the_side_work_less_room_than_packed_ones():
    """A sweep launch of 66 programs at 2 per SM: packed they hold 33 of the H200's 132 SMs
    and leave 3/4 of its time to side work; spread, one per SM, they leave half. The gap
    before the launch is the side work's either way."""
    from gpn_scale.accounting import pricing, step_model
    from gpn_scale.accounting.kernel_costs import KernelCost
    from gpn_scale.accounting.kernel_record import Op

    c = step_model.gpu_ceilings("h200")
    cost = KernelCost("k", 66, 2, 128, 0, 0, 0.0)
    ops = [Op("reverse step: k", "sequential backward", 0, 0, True, cost=cost)]
    gap = pricing.gap_s(ops[0])
    spare = {
        pl: step_model._spare(ops, "sequential backward", c, lambda op: gap + 1e-3, pl)
        for pl in step_model.PLACEMENTS
    }
    assert spare[step_model.PACKED] == pytest.approx(gap + 0.75e-3)
    assert spare[step_model.SPREAD] == pytest.approx(gap + 0.5e-3)
    with pytest.raises(ValueError, match="placement: expected one of packed, spread"):
        step_model._spare(ops, "sequential backward", c, lambda op: 1.0, "scattered")


def test_ceilings_come_from_the_newest_run_that_measured_them(tmp_path):
    base = ceilings.for_gpu("h200", tmp_path)
    assert base == ceilings.DEFAULTS["h200"]
    for name, copy in (("2027-01-01-h200", 3.9e12), ("2027-02-01-h200", 4.1e12)):
        (tmp_path / name).mkdir()
        blob = {"meta": {"device_name": "NVIDIA H200"}, "ceilings": {"copy_bytes_per_s": copy}}
        (tmp_path / name / device_runs.RESULTS).write_text(json.dumps(blob))
    (tmp_path / "2027-03-01-h100").mkdir()
    (tmp_path / "2027-03-01-h100" / device_runs.RESULTS).write_text(
        json.dumps(
            {
                "meta": {"device_name": "NVIDIA H100 80GB HBM3"},
                "ceilings": {"copy_bytes_per_s": 1.0},
            }
        )  # fmt: skip
    )
    got = ceilings.for_gpu("h200", tmp_path)
    assert got.copy_bytes_per_s == 4.1e12
    assert got.source("copy_bytes_per_s") == "measured, 2027-02-01-h200"
    assert got.latency_s == base.latency_s  # not measured: the default and its source
    assert any("HBM copy 4.10 TB/s (measured" in line for line in ceilings.describe(got))


def test_cublas_is_priced_at_the_share_of_the_copy_a_run_measured_it_at(tmp_path):
    """`Ceilings.cublas_step_share`: an estimate until a run's ceilings time cuBLAS at the
    step's GEMMs; then the median of their shares of that run's own copy bandwidth (the
    chunk-wide GEMM and rows without a rate left out)."""
    base = ceilings.DEFAULTS["h200"]
    assert 0 < base.cublas_step_share < 1 and "est." in base.source("cublas_step_share")
    rows = [
        {"role": "input", "gbytes_per_s": 2000.0},
        {"role": "down_dx", "gbytes_per_s": 3000.0},
        {"role": "fuse_gate", "gbytes_per_s": 3600.0},
        {"role": "fuse_gate_dx", "error": "out of memory"},
        {"role": "chunk-wide input", "gbytes_per_s": 500.0},
    ]
    got = ceilings.with_measured(base, {"copy_bytes_per_s": 4.0e12, "gemms": rows}, "run X")
    assert got.cublas_step_share == pytest.approx(0.75)  # 2000, 3000, 3600 over 4 TB/s
    assert got.source("cublas_step_share").startswith("run X")
    # a run without its own copy figure leaves the estimate: a share needs both of one run
    assert ceilings.with_measured(base, {"gemms": rows}, "run Y") == base
    assert any("cuBLAS at the step GEMMs 75%" in line for line in ceilings.describe(got))


def test_a_step_gemm_through_cublas_streams_at_its_share_of_the_copy():
    from gpn_scale.accounting import pricing
    from gpn_scale.accounting.kernel_record import Op

    c = ceilings.DEFAULTS["h200"]
    op = Op("reverse step: down dy W^T 0 (cuBLAS)", "sequential backward", 10**8, 10**9, True)
    cublas = Op(op.name, op.phase, op.bytes, op.flops, True, cublas=True)
    plain, through = pricing.price(op, c, True), pricing.price(cublas, c, True)
    assert through.bound == "hbm" and through.hbm_seconds == plain.hbm_seconds
    moved = op.bytes / c.copy_bytes_per_s
    assert through.seconds - pricing.GRAPH_GAP_S == pytest.approx(moved / c.cublas_step_share)


def test_json_prediction_has_the_step_the_floor_and_the_compiled_anchor(capsys):
    assert gpu_model.main(["tiny", "--batch", "2", "--seq-len", "16", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    for key in ("predicted_s", "serial_floor_s", "tokens_per_s", "baseline_tokens_per_s"):
        assert got[key] > 0, key
    assert got["baseline_eager_tokens_per_s"] < got["baseline_tokens_per_s"]  # compile fuses
    assert got["serial_floor_s"] < got["predicted_s"]
    assert got["gpn_over_compiled_transformer"] == pytest.approx(
        got["tokens_per_s"] / got["baseline_tokens_per_s"]
    )
    assert got["kernels"][0]["predicted_s"] >= got["kernels"][-1]["predicted_s"]
    # a role's counted bytes over its time: never above the copy bandwidth it is priced at
    assert all(0 <= k["bandwidth_share"] <= 1 + 1e-9 for k in got["kernels"]), got["kernels"]
    assert any(k["bandwidth_share"] > 0 for k in got["kernels"])
    assert set(got["ceilings"]) >= set(ceilings.MEASURED_KEYS)
    # the side streams priced were each sweep program alone on an SM too: never faster
    assert got["spread_placement"]["predicted_s"] >= got["predicted_s"]


def _overlapped_copy(tmp_path) -> tuple:
    """A copy of the 2026-12-04 run that says it ran with both side streams, and its
    results.json as a dict."""
    run = tmp_path / "2027-01-01-h200"
    run.mkdir()
    for path in device_runs.resolve(RUN).iterdir():
        (run / path.name).write_bytes(path.read_bytes())
    blob = json.loads((run / device_runs.RESULTS).read_text())
    blob["meta"].update(overlap_backward=True, overlap_decode=True)
    (run / device_runs.RESULTS).write_text(json.dumps(blob))
    return run, blob


def test_a_run_is_priced_with_the_side_streams_it_ran_with(tmp_path):
    """The 2026-12-04 run predates both side streams: priced without them. A run that says
    it overlapped is priced with them, so the same launches predict a shorter step."""
    plain = gpu_report.against("gpn_m_130m", RUN, batches=[64])["steps"][0]["predicted_s"]
    run, _ = _overlapped_copy(tmp_path)
    overlapped = gpu_report.against("gpn_m_130m", str(run), batches=[64])["steps"][0]
    assert overlapped["predicted_s"] < plain


def test_a_run_that_measured_the_placement_has_its_side_work_priced_so(tmp_path, capsys):
    """A run whose probe (bench/gpu_placement.py) found grids spread over the SMs prices its
    side work spread, which hides less than the packed default: a longer predicted step."""
    run, blob = _overlapped_copy(tmp_path)
    packed = gpu_report.against("gpn_m_130m", str(run), batches=[64])
    assert packed["placement"] == {"measured": None, "priced": "packed"}
    blob["placement"] = {"placement": "spread", "emulated": False, "grids": []}
    (run / device_runs.RESULTS).write_text(json.dumps(blob))
    spread = gpu_report.against("gpn_m_130m", str(run), batches=[64])
    assert spread["placement"] == {"measured": "spread", "priced": "spread"}
    assert spread["steps"][0]["predicted_s"] > packed["steps"][0]["predicted_s"]
    blob["placement"]["placement"] = "mixed"  # the grids disagreed: the default stands
    (run / device_runs.RESULTS).write_text(json.dumps(blob))
    mixed = gpu_report.against("gpn_m_130m", str(run), batches=[64])
    assert mixed["steps"][0]["predicted_s"] == packed["steps"][0]["predicted_s"]
    assert gpu_model.main(["gpn_m_130m", "--against", str(run)]) == 0
    out = capsys.readouterr().out
    assert "The run measured the block scheduler's placement: mixed; the side work is " in out
