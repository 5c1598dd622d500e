"""The GPU session's device-check script (gpn_scale/bench/gpu.py): end to end in its CPU
smoke mode (the ledger's replay in Triton's interpreter, the phases, the ceilings at tiny
sizes, the trace, the throughput), plus the pieces a CPU cannot show (no CUDA, out of memory,
the time budget, profiler event accounting) and the Transformer++ baseline it measures beside
the GPN."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gpn_scale.bench import gpu, gpu_exactness, gpu_ledger, gpu_throughput
from gpn_scale.models.gpn import load_model_config
from gpn_scale.models.gpn.counts import count_parameters
from gpn_scale.models.transformer_pp.counts import count_parameters as tpp_parameters
from gpn_scale.models.transformer_pp.counts import matching_config
from gpn_scale.models.transformer_pp.model import TransformerPP

SMOKE = [
    "--device",
    "cpu",
    "--config",
    "tiny,tiny_2l",
    "--seq-len",
    "16",
    "--batches",
    "4,2",
    "--steps",
    "1",
    "--warmup",
    "0",
    "--fp32",
]
# The tests of the throughput's bookkeeping leave the decision data out (the first test runs
# it all).
FAST = [*SMOKE, "--no-ledger", "--no-ceilings", "--no-engine-ab"]


@pytest.fixture
def passing_comparisons(monkeypatch):
    """The exactness checks' comparisons stood in for by rows that pass, for the tests of
    what the run records around them: `check_exactness` still runs each case through
    `guarded`, in order, but none steps a model in Triton's interpreter (~30 s a run here;
    test_device_check_runs_and_records runs them all)."""

    def engine(device, tokens, dtype, graphs, name, *rest):
        return dict(check=name, ok=True)

    def bit_identical(device, tokens, name, *rest):
        return dict(check=name, ok=True)

    monkeypatch.setattr(gpu_exactness, "_engine_against_reference", engine)
    monkeypatch.setattr(gpu_exactness, "_bit_identical", bit_identical)
    monkeypatch.setattr(
        gpu_exactness,
        "_bf16_autocast_step",
        lambda device, tokens: dict(check="bf16 autocast step", ok=True),
    )


def test_device_check_runs_and_records(tmp_path):
    """Everything the device check does, in its CPU smoke mode: the ledger (every launch of
    the recorded step has a row with its role, bytes and FLOPs), the phase split, the
    ceilings and the placement probe, the trace, the throughput and the device-run summary
    the accounting reads."""
    model = tmp_path / "tiny_c4.yaml"  # a 4-step chunk: the interpreter replays every launch
    model.write_text(_tiny_yaml(chunk_size=4, vocab_size=64, name="tiny_c4"))
    out = tmp_path / "out"
    args = [*SMOKE, "--ledger-batches", "2", "--repeats", "1"]
    args[args.index("tiny,tiny_2l")] = f"{model},tiny_2l"
    rc = gpu.main([*args, "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    checks = result["checks"]
    assert all(c["ok"] for c in checks)
    float32 = [c["check"] for c in checks if c["check"].startswith("engine") and "32" in c["check"]]
    (gdn,) = [c for c in checks if c["check"].startswith("GDN fla")]
    assert gdn["skipped"] == "needs CUDA"  # fla's kernels need a GPU: said, not faked
    assert float32 == [
        "engine == reference, float32, CUDA graphs on",
        "engine == reference, float32, CUDA graphs off",
        "engine == reference, float32, bf16 memory reads",
    ]
    assert "engine == reference, float64, CUDA graphs on, cuBLAS step GEMMs" in {
        c["check"] for c in checks
    }
    # the ledger: one row per distinct launch, every role of the recorded step present
    rows = result["ledger"]["rows"]
    cfg = gpu_ledger.load_model_config(str(model))
    recorded = gpu_ledger.record_step(cfg, 2, torch.device("cpu"), bf16=False)
    assert {r.role for r in recorded} == {r["role"] for r in rows}
    assert all(r["role"] and r["bytes"] > 0 and r["alone_s"] > 0 for r in rows)
    # the memory kernels' what-ifs beside their shipped settings, and in results.md
    what_ifs = result["ledger"]["what_ifs"]
    assert {r["setting"] for r in what_ifs} == {
        "shipped",
        *(label for options in gpu_ledger.WHAT_IFS.values() for label, _ in options),
    }
    assert "## What-ifs" in (out / "results.md").read_text()
    # the accounting's prediction per role (its dry run sizes the GEMM grids for 132 SMs, the
    # interpreter's for 16: a split-K sum may be one side's only)
    assert all(r["predicted_s_per_step"] for r in rows if "split-K" not in r["role"])
    assert {p["batch"] for p in result["phases"]} == {2}
    assert "sequential forward" in result["phases"][0]["phases_s"]
    ceilings = result["ceilings"]
    assert all(ceilings[k] > 0 for k in ("copy_bytes_per_s", "latency_s", "l2_bytes_per_s"))
    placement = result["placement"]  # the block scheduler's, on the interpreter's emulated SMs
    assert placement["emulated"] and placement["grids"] and "beside" in placement
    assert (out / result["trace"]["trace"]).stat().st_size > 0
    runs = result["runs"]
    tpp = [r["model"] for r in runs if r["family"] == "transformer++"]
    # the first config again with each engine A/B option off, at the last ledger batch
    plain = f"{cfg.name} (overlap off)"
    independent = f"{cfg.name} (dependent launch off)"
    all_sms = f"{cfg.name} (side-work SMs off)"
    bf16_reads = f"{cfg.name} (bf16 memory reads)"
    cublas = f"{cfg.name} (cuBLAS step GEMMs)"
    assert [r["model"] for r in runs] == [str(cfg.name)] * 2 + [
        plain,
        independent,
        all_sms,
        bf16_reads,
        cublas,
    ] + ["tiny_2l"] * 2 + tpp[:1] * 2
    assert [r["batch"] for r in runs] == [2, 4, 2, 2, 2, 2, 2, 2, 4, 2, 4]  # increasing order
    assert result["summary"][plain]["config"] == (
        "tiny_c4 engine.overlap_backward=false engine.overlap_decode=false"
    )
    assert result["summary"][independent]["config"] == "tiny_c4 engine.dependent_launch=false"
    assert result["summary"][all_sms]["config"] == "tiny_c4 engine.side_work_sm_share=0.0"
    assert result["summary"][bf16_reads]["config"] == "tiny_c4 engine.bf16_memory_reads=true"
    assert result["summary"][cublas]["config"] == "tiny_c4 engine.cublas_gemms=all"
    for name in ("overlapped backward", "dependent launches", "memory backward leaving SMs"):
        (same,) = [c for c in checks if c["check"].startswith(name)]
        assert same["ok"] and same["differing"] == 0 and same["tensors"] > 20
    for r in runs:
        assert r["tokens_per_s"] > 0 and r["mfu"] is None  # no peak on a CPU
        assert r["peak_allocated_gb"] is None and r["peak_reserved_gb"] is None
        assert r["gpu_busy_fraction"] is None and r["kernels_per_step"] == 0
        assert r["profiled_seq_len"] == 16
    # the engine options the accounting prices a run with (gpu_report.against)
    meta = result["meta"]
    assert meta["overlap_backward"] and meta["overlap_decode"] and meta["dependent_launch"]
    assert meta["side_work_sm_share"] == 0.25 and meta["bf16_memory_reads"] is False
    params = result["meta"]["params"]
    assert abs(params[tpp[0]] / params["tiny_c4"] - 1) < 0.1  # same size, side by side
    summary = result["summary"]
    assert [row["batch"] for row in summary["tiny_2l"]["rows"]] == [2, 4]
    assert set(summary["tiny_2l"]["rows"][0]) == {"batch", "tokens_per_s", "step_s", "mfu"}
    assert summary["gpn_over_compiled_transformer"] is None  # no compiled baseline on CPU
    ratio = summary["ratio_to_transformer_pp"]
    best = max(r["tokens_per_s"] for r in runs if r["model"] == "tiny_2l")
    best_t = max(r["tokens_per_s"] for r in runs if r["model"] == tpp[0])
    assert ratio["tiny_2l"]["ratio"] == pytest.approx(best / best_t)
    md = (out / "results.md").read_text()
    assert "| 4 |" in md and "peak reserved GB" in md and "GPU busy" in md
    assert "Where the step goes" in md and "Ceilings measured" in md
    assert "Block scheduler placement" in md
    assert "GPN / Transformer++ tokens/s, each at its best batch" in md


def _tiny_yaml(**changes) -> str:
    """The tests' tiny GPN+M (testing/models.py) as a model YAML: the interpreter runs the
    ledger's every launch over its small tiles in seconds."""
    import yaml

    from gpn_scale.testing.models import tiny_config

    return yaml.safe_dump(tiny_config(**changes).to_dict())


def test_results_are_on_disk_after_every_step(tmp_path, monkeypatch, passing_comparisons):
    """A run cut short keeps what it measured: each batch starts with every earlier row
    (and every exactness check) already in results.json."""
    seen = []

    def fake(cand, batch, seq_len, *args):
        blob = json.loads((tmp_path / "results.json").read_text())
        seen.append((len(blob["checks"]), [(r["model"], r["batch"]) for r in blob["runs"]]))
        return _row(cand, batch, seq_len)

    monkeypatch.setattr(gpu_throughput, "measure", fake)
    assert gpu.main([*FAST, "--no-transformer", "--out", str(tmp_path)]) == 0
    n_checks = len(json.loads((tmp_path / "results.json").read_text())["checks"])
    assert seen == [
        (n_checks, []),
        (n_checks, [("tiny", 2)]),
        (n_checks, [("tiny", 2), ("tiny", 4)]),
        (n_checks, [("tiny", 2), ("tiny", 4), ("tiny_2l", 2)]),
    ]


def _row(cand, batch, seq_len):
    return dict(
        model=cand.name,
        family=cand.family,
        batch=batch,
        seq_len=seq_len,
        step_s=1.0,
        tokens_per_s=float(batch * seq_len),
        mfu=None,
        peak_allocated_gb=None,
        peak_reserved_gb=None,
        gpu_busy_fraction=None,
        kernels_per_step=0,
        kernels_per_time_step=0.0,
        launch_calls_per_time_step=0.0,
    )


def test_a_failing_check_or_model_is_a_row_and_the_rest_still_runs(
    tmp_path, monkeypatch, passing_comparisons
):
    """Device time is scarce: a kernel that does not compile in one exactness case (as the
    H200 image's triton 3.6 did in fp64) or one model whose step fails is recorded, and the
    other checks and models still run; the exit status says something failed."""
    real = gpu_exactness._engine_against_reference

    def fp64_fails(device, tokens, dtype, graphs, name, *options):
        if name == "engine == reference, float64":  # that case alone
            raise RuntimeError("CompilationError: at 126:19:\n  acc = tl.dot(...)")
        return real(device, tokens, dtype, graphs, name, *options)

    def first_model_fails(cand, batch, seq_len, *args):
        if cand.name == "tiny":
            raise RuntimeError("an illegal memory access was encountered")
        return _row(cand, batch, seq_len)

    monkeypatch.setattr(gpu_exactness, "_engine_against_reference", fp64_fails)
    monkeypatch.setattr(gpu_throughput, "measure", first_model_fails)
    assert gpu.main([*FAST, "--no-transformer", "--out", str(tmp_path)]) == 1
    blob = json.loads((tmp_path / "results.json").read_text())
    failed = [c for c in blob["checks"] if not c["ok"]]
    assert failed == [
        dict(
            check="engine == reference, float64",
            error="RuntimeError: CompilationError: at 126:19:",
            ok=False,
        )
    ]
    assert len(blob["checks"]) >= 4  # fp32 with and without graphs, bf16, fla still ran
    assert blob["runs"][0] == dict(
        model="tiny",
        family="gpn+m",
        batch=2,
        error="RuntimeError: an illegal memory access was encountered",
    )
    assert [(r["model"], r["batch"]) for r in blob["runs"][1:]] == [("tiny_2l", 2), ("tiny_2l", 4)]
    assert (
        "**RuntimeError: an illegal memory access was encountered**"
        in (tmp_path / "results.md").read_text()
    )


def test_batch_search_doubles_past_128_until_out_of_memory(
    tmp_path, monkeypatch, passing_comparisons
):
    def fake(cand, batch, seq_len, *args):
        if batch >= 1024:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return _row(cand, batch, seq_len)

    monkeypatch.setattr(gpu_throughput, "measure", fake)
    rc = gpu.main(
        [
            "--device",
            "cpu",
            "--config",
            "tiny",
            "--seq-len",
            "16",
            "--no-transformer",
            "--batches",
            "auto",
            "--no-ledger",
            "--no-ceilings",
            "--no-engine-ab",
            "--out",
            str(tmp_path),
        ]
    )
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert rc == 0 and [r["batch"] for r in runs] == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert runs[-1] == {"model": "tiny", "family": "gpn+m", "batch": 1024, "oom": True}
    assert "out of memory" in (tmp_path / "results.md").read_text()


def test_time_budget_stops_before_a_batch_that_would_overrun(monkeypatch):
    """The next batch is predicted to cost twice the last one's steps (a fake clock, no
    timing): 1 timed + 2 profiled steps per batch here."""
    clock = [100.0]
    monkeypatch.setattr(gpu_throughput, "_clock", lambda: clock[0])

    def fake(cand, batch, seq_len, *args):
        row = dict(_row(cand, batch, seq_len), step_s=batch / 8)  # compute-bound
        clock[0] += 3 * row["step_s"] + (30.0 if batch == 8 else 0.0)  # + a first compile
        return row

    monkeypatch.setattr(gpu_throughput, "measure", fake)
    cand = gpu_throughput.gpn_candidate(load_model_config("tiny"), 16)
    rows: list[dict] = []
    gpu_throughput.sweep(
        cand,
        gpu_throughput.batch_sizes("auto", 8, 1 << 20),
        16,
        torch.device("cpu"),
        1,
        0,
        False,
        deadline=100.0 + 45.0,
        record=rows.append,
    )
    # 8 ends at t=133 (compile included), 16 is predicted 6 s and ends at 139; 32 would need
    # 12 s more (151 > 145): skipped.
    assert [r["batch"] for r in rows] == [8, 16, 32]
    assert rows[-1]["skipped"].startswith("time budget")


def test_stops_at_once_with_one_line_when_cuda_is_not_usable(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = gpu.main(["--device", "cuda", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("device check: CUDA is not usable on --device cuda")
    assert f"built for CUDA {torch.version.cuda}" in err[0] and "driver" in err[0]
    assert not (tmp_path / "out").exists()  # stopped before anything else


def test_refuses_to_overwrite_earlier_results(tmp_path, capsys):
    (tmp_path / "results.json").write_text("{}")
    assert gpu.main([*FAST, "--out", str(tmp_path)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (tmp_path / "results.json").read_text() == "{}"


def test_device_activity_counts_launches_and_busy_time_once_per_overlap():
    ms = 1_000_000
    events = [
        ("kernel", "gemm", 0, 4 * ms),
        ("kernel", "gate", 2 * ms, 5 * ms),  # overlap
        ("gpu_memcpy", "Memcpy HtoD", 8 * ms, 9 * ms),
        ("kernel", "norm", 10 * ms, 11 * ms),
        ("cuda_runtime", "cudaLaunchKernel", 0, 1),
        ("cuda_driver", "cuLaunchKernelEx", 0, 1),
        ("cuda_runtime", "cudaGraphLaunch", 0, 1),
        ("cuda_runtime", "cudaMemcpyAsync", 0, 1),
        ("cpu_op", "aten::mm", 0, 1),
    ]
    got = gpu_throughput.device_activity(events)
    got.pop("top_device_work")  # its own test below
    assert got == dict(
        kernels=3,
        copies=1,
        launch_calls=2,
        graph_launches=1,
        cpu_ops=1,
        device_busy_s=pytest.approx(7e-3),
    )


# ----------------------------------------------------------------------- Transformer++
def test_activity_kinds_without_the_events_activity_type():
    """torch 2.11 (the H200 image) has no _KinetoEvent.activity_type: the kinds follow from
    the device and the names, and count as the newer torch's kinds do."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    class Event:
        def __init__(self, device, name):
            self._device, self._name = device, name

        def device_type(self):
            return self._device

        def name(self):
            return self._name

    kinds = [
        gpu_throughput.activity_kind(Event(d, n))
        for d, n in [
            (cuda, "triton_linear_kernel"),
            (cuda, "Memcpy DtoD (Device -> Device)"),
            (cuda, "Memset (Device)"),
            (cpu, "cudaLaunchKernel"),
            (cpu, "cuLaunchKernel"),
            (cpu, "cudaGraphLaunch"),
            (cpu, "aten::mm"),
        ]
    ]
    assert kinds == [
        "kernel",
        "gpu_memcpy",
        "gpu_memset",
        "cuda_runtime",
        "cuda_driver",
        "cuda_runtime",
        "cpu_op",
    ]
    events = [
        (k, n, i, i + 1)
        for i, (k, n) in enumerate(
            zip(
                kinds,
                ["k", "c", "s", "cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "mm"],
            )
        )
    ]
    counts = gpu_throughput.device_activity(events)
    assert (counts["kernels"], counts["copies"], counts["launch_calls"]) == (1, 2, 2)
    assert (counts["graph_launches"], counts["cpu_ops"]) == (1, 1)


def test_device_time_by_kernel_is_ranked_and_totals_each_name():
    events = [
        ("kernel", "gemm", 0, 10),
        ("kernel", "memory_backward_kernel", 10, 40),
        ("kernel", "gemm", 40, 55),
        ("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 55, 60),
        ("cuda_runtime", "cudaLaunchKernel", 0, 1),
    ]
    top = gpu_throughput.device_activity(events)["top_device_work"]
    assert top == [
        dict(name="memory_backward_kernel", count=1, seconds=30e-9),
        dict(name="gemm", count=2, seconds=25e-9),
        dict(name="Memcpy DtoD (Device -> Device)", count=1, seconds=5e-9),
    ]


def test_transformer_pp_matches_the_gpn_parameter_count():
    """The side-by-side Transformer++ is the family's model, sized to the GPN."""
    for name in ("gpn_m_130m", "gpn_m_130m_2l", "tiny"):
        cfg = load_model_config(name)
        tcfg = matching_config(cfg.vocab_size, cfg.d_emb, count_parameters(cfg))
        assert abs(tpp_parameters(tcfg) / count_parameters(cfg) - 1) < 0.01, name
        assert tcfg.d_model == cfg.d_emb and tcfg.d_model % tcfg.n_heads == 0
        assert tcfg.tie_embeddings and 2 <= tcfg.d_ffn / tcfg.d_model <= 3.5  # LLaMA-like
    tiny = matching_config(512, 64, count_parameters(load_model_config("tiny")))
    model = TransformerPP(tiny)
    assert sum(p.numel() for p in model.parameters()) == tpp_parameters(tiny)
    cand = gpu_throughput.transformer_candidate(load_model_config("tiny"), 64)
    assert cand.params == tpp_parameters(tiny)


def test_transformer_pp_is_causal_and_trains():
    torch.manual_seed(0)
    cfg = matching_config(97, 64, 120_000)
    model = TransformerPP(cfg)
    a = torch.randint(0, 97, (2, 16))
    b = a.clone()
    b[:, 9:] = (b[:, 9:] + 1) % 97  # only the future differs

    def logits(tokens):
        return model(tokens, return_logits=True).logits

    # logits[:, t] predict token t from tokens < t: the first 10 see none of the change.
    assert torch.equal(logits(a)[:, :10], logits(b)[:, :10])
    assert not torch.allclose(logits(a)[:, 10:], logits(b)[:, 10:])
    loss = model(a).loss
    assert abs(loss.item() - math.log(97)) < 0.5  # near uniform at init
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_fla_refusing_this_triton_is_a_skip_and_other_errors_are_not(monkeypatch):
    """fla 0.6 raises for triton 3.4-3.7.0 on Hopper (the H200 image's 3.6): nothing to
    compare, and not our fault; any other error stays a failure."""
    refusal = (
        "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated "
        "chunk_bwd_dqkwg (see #640). Please upgrade Triton to >= 3.7.1"
    )

    def refuse(*args, **kwargs):
        raise RuntimeError(refusal)

    monkeypatch.setattr(gpu_exactness, "compare_gdn_backends", refuse)
    row = gpu_exactness.guarded("GDN", gpu_exactness._compare_gdn_row, torch.device("cpu"), "GDN")
    assert row["ok"] and row["skipped"].startswith(
        "fla refuses this Triton: RuntimeError: Triton >= 3.4.0"
    )

    def broken(*args, **kwargs):
        raise RuntimeError("an illegal memory access was encountered")

    monkeypatch.setattr(gpu_exactness, "compare_gdn_backends", broken)
    row = gpu_exactness.guarded("GDN", gpu_exactness._compare_gdn_row, torch.device("cpu"), "GDN")
    assert row == dict(
        check="GDN", error="RuntimeError: an illegal memory access was encountered", ok=False
    )


def test_gdn_backend_comparison_sees_agreement_and_a_difference():
    """The comparison the device check runs for fla, on two CPU backends: our chunkwise op
    and the step-by-step recurrence agree within float32 rounding, and the check fails when
    the errors exceed its tolerance (zero here)."""
    ok = gpu_exactness.compare_gdn_backends(
        torch.device("cpu"), "chunk", "recurrent", tolerance=1e-4
    )
    assert ok["ok"] and 0 <= ok["grad_rel_err"] < 1e-4 and ok["continuation_rel_err"] < 1e-4
    strict = gpu_exactness.compare_gdn_backends(
        torch.device("cpu"), "chunk", "recurrent", tolerance=0.0
    )
    assert not strict["ok"] or max(strict[k] for k in strict if k.endswith("_err")) == 0.0


def test_the_input_gemms_dy_wt_what_if_is_the_narrow_plan_at_the_shipped_size():
    """At 130M, B = 128 on an H100/H200 the input GEMM's dy W^T ships 256-wide panels (80
    programs); its what-if is the plan sm_80 gets, 128-wide panels in 6 splits (120), which
    the device check times beside it. Other GEMMs have none."""
    from gpn_scale.accounting.gpu_compile_cases import Case, record_launches

    launches = record_launches(Case("gpn_m_130m", 128, shipped=True), 132, 90)
    gemms = [
        r for r in launches if r.kernel is not None and r.kernel.fn.__name__ == "linear_kernel"
    ]
    (dy_wt,) = {r.name: r for r in gemms if r.name.startswith("input dy W^T")}.values()
    assert (dy_wt.meta["BLOCK_N"], dy_wt.meta["SPLITS"], dy_wt.grid) == (256, 8, (1, 10, 8))
    change, grid = gpu_ledger._gemm_plan_on_sm80(gpu_ledger.Recorded(0, dy_wt, None))
    assert (change["BLOCK_N"], change["SPLITS"], change["num_stages"], grid) == (
        128,
        6,
        3,
        (1, 20, 6),
    )
    others = [r for r in gemms if not r.name.startswith("input dy W^T")]
    assert others and all(
        gpu_ledger._gemm_plan_on_sm80(gpu_ledger.Recorded(0, r, None)) is None for r in others
    )


def test_the_prebuild_compiles_the_engine_ab_rows_kernels(tmp_path, monkeypatch):
    """The prebuild's gpu_compile runs (each a process; recorded here, not run): the tiny
    exactness configs, every config at the check's batches, and the first config without
    dependent launches, without SMs left to side work, with bf16 memory reads and with
    cuBLAS step GEMMs at the A/B batch (their PDL=False, plain memory backward, bf16 M0 and
    epilogue-after-cuBLAS variants), each into the cache."""
    commands: list[list[str]] = []

    def run(cmd, **kwargs):
        commands.append(cmd)
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(gpu.subprocess, "run", run)
    cache = tmp_path / "cache"
    got = gpu.prebuild_triton_cache(
        cache, ["gpn_m_130m", "gpn_m_130m_2l"], 2048, "sm_90", tmp_path / "log", 60.0, 128
    )
    assert got["ok"] and cache.is_dir()
    assert all(c[1:3] == ["-m", "gpn_scale.accounting.gpu_compile"] for c in commands)
    assert all(c[c.index("--triton-cache") + 1] == str(cache) for c in commands)
    assert all(c[c.index("--arch") + 1] == "sm_90" for c in commands)
    assert "cublas_gemms=all" in gpu.PREBUILD_AB
    for flag in gpu.PREBUILD_AB:
        (plain,) = [c for c in commands if flag in c]
        assert plain[3] == "gpn_m_130m" and plain[plain.index("--batch") + 1] == "128"
        assert plain[plain.index("--seq-len") + 1] == "2048"
    commands.clear()
    gpu.prebuild_triton_cache(cache, ["gpn_m_130m"], 2048, "sm_90", tmp_path / "log", 60.0)
    assert len(commands) == 3 and not any(f in c for c in commands for f in gpu.PREBUILD_AB)
