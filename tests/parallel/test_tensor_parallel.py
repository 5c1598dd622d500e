"""Tensor parallelism (parallel.tp) of GPN+M's wide state, on CPU with gloo, real processes.

- The engine with its parameters sharded over tp = 2 and tp = 4 ranks equals one process in
  float64: two windows with the carry between them (1 and 2 layers, GPN without memory,
  truncated BPTT), every gradient and the final carry (`tp_engine_worker.py`), with the
  PyTorch steps and with the CUDA backend (its Triton kernels in Triton's interpreter).
- The trainer at tp = 2 and at dp = 2 x tp = 2 (4 processes) gives the single process's
  losses and gradient norms at every step and its final weights (fp32, the tolerances of
  test_parallel_strategies.py); a 2-layer model with truncated BPTT and the state carried
  from batch to batch too.
- Bad configs fail in one line naming the field.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from train_helpers import (
    PY,
    REPO,
    child_env,
    grad_norms,
    initial_weights,
    read_metrics,
    run_train,
    train_args,
    train_losses,
    weight_distance,
)

from gpn_scale.core.config import ConfigError

TOTAL = 4
COMMON = (
    f"schedule.total_steps={TOTAL}",
    "checkpoint.every_steps=2",
    "checkpoint.export_final=true",
    "train.global_batch_size=4",
)
# 2 layers, truncated BPTT inside the 64-token window, the state carried across batches.
STATEFUL = ("model_overrides.n_layers=2", "train.tbptt=24", "train.stateful_windows=true")
LOSS_RTOL = 2e-6
GRAD_NORM_RTOL = 1e-5
# Final weights after 4 AdamW steps in fp32. Under tp the vocabulary-parallel loss sums each
# row's softmax denominator and dh = g @ E over the group's shards, so dP differs from the
# single process by rounding (the float64 engine test above holds it equal to 1e-9, and 4
# AdamW steps of the sharded model in float64 stay within 2e-13); Adam's normalisation
# magnifies fp32 rounding on near-zero gradients: measured rel 1.7e-4 / worst 1.9e-4 at tp2
# (read.query; the same with another loss block size), 8e-6 at dp2 x tp2, and ~1.1e-4
# already before the vocabulary-parallel loss in 4 AdamW steps on random batches.
WEIGHT_REL = 5e-4
WEIGHT_ATOL = 5e-4


def _compare(ref_dir: Path, run_dir: Path, overrides: tuple[str, ...] = ()) -> None:
    ref, got = train_losses(ref_dir), train_losses(run_dir)
    assert sorted(got) == list(range(1, TOTAL + 1))
    for s in got:
        assert got[s] == pytest.approx(ref[s], rel=LOSS_RTOL, abs=0), (s, got[s], ref[s])
    evals = [
        [(r["step"], r["eval/tokens"], r["eval/loss"]) for r in read_metrics(d) if "eval/loss" in r]
        for d in (ref_dir, run_dir)
    ]
    assert evals[0] and len(evals[0]) == len(evals[1])
    for (s, tok, loss), (s2, tok2, loss2) in zip(*evals):  # held-out tokens counted once
        assert (s, tok) == (s2, tok2) and loss2 == pytest.approx(loss, rel=LOSS_RTOL)
    ref_g, got_g = grad_norms(ref_dir), grad_norms(run_dir)
    for s in got_g:  # replicated parameters counted once, shards all counted
        assert got_g[s] == pytest.approx(ref_g[s], rel=GRAD_NORM_RTOL), (s, got_g[s], ref_g[s])
    a = torch.load(ref_dir / "model_final.pt")
    b = torch.load(run_dir / "model_final.pt")  # gathered to the full (logical) tensors
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    init = initial_weights() if not overrides else a  # (the 2-layer run: equality only)
    if overrides:
        worst = max(float((a[k] - b[k]).abs().max()) for k in a)
        assert worst < WEIGHT_ATOL, worst
        return
    rel, worst = weight_distance(a, b, init)
    assert rel < WEIGHT_REL and worst < WEIGHT_ATOL, (rel, worst)


@pytest.fixture(scope="module")
def single(corpus, once_per_run):
    return once_per_run("tp_single", lambda base: run_train(corpus, base / "run", *COMMON)) / "run"


# The TP copy's step backend: the PyTorch steps (every case at full size), and the CUDA
# backend's Triton kernels run by Triton's interpreter on CPU tensors (slow: fewer cases,
# tbptt-2-layer standing for 2 layers, windows of 2 x 6 tokens; one case in float32 too):
# eagerly at tp = 2, and at tp = 4 (one head per rank) through its chunk graphs (the eager
# capture stand-in; the same kernels, replayed).
ENGINE_RUNS = {
    "reference-tp2": (2, ["--backend", "reference"]),
    "reference-tp4": (4, ["--backend", "reference"]),
    "cuda-tp2": (
        2,
        [
            *("--backend", "cuda", "--shape", "2,6"),
            *("--cases", "1-layer,gpn-no-memory,tbptt-2-layer", "--float32-cases", "1-layer"),
        ],
    ),
    "cuda-graphs-tp4": (
        4,
        ["--backend", "cuda-graphs", "--shape", "2,6", "--cases", "tbptt-2-layer"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("run", list(ENGINE_RUNS))
def test_sharded_engine_equals_one_process_float64(tmp_path, run):
    tp, args = ENGINE_RUNS[run]
    out = tmp_path / "errors.json"
    worker = Path(__file__).with_name("tp_engine_worker.py")
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}"]
    proc = subprocess.run(
        [*cmd, str(worker), str(out), *args],
        cwd=REPO,
        env=child_env(tmp_path),
        text=True,
        capture_output=True,
        timeout=300,
    )
    # whether the workers had finished: a crash before or after their results were written
    assert proc.returncode == 0, f"results written: {out.exists()}\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    chunk_graphs = result.pop("graphs", None)
    if run.startswith("cuda"):  # the graph path replays (tbptt-2-layer: 3 chunk shapes)
        graphed = run.startswith("cuda-graphs")
        assert chunk_graphs is not None and (chunk_graphs["replays"] > 0) == graphed
    assert result
    for case, errors in result.items():
        # eager CUDA: the dry launch accounting at this tp counts what the rank launched
        assert ("launch accounting" in errors) == (run.startswith("cuda-tp")), case
        assert len(errors) > 10, case  # loss, state, memory and every gradient
        # float32: the PyTorch steps at tp = 2 differ from one process by up to ~1e-4
        # relative (the sums of sharded partials in another order), the Triton kernels alike.
        tol = 1e-3 if case.endswith("float32") else 1e-9
        for what, err in errors.items():
            assert err < tol, (case, what, err)


def test_step_backends_under_tp_cuda_runs_cpu_is_refused(monkeypatch):
    from gpn_scale.ops.gpn_step import registry
    from gpn_scale.ops.gpn_step.registry import ENV_VAR, StepBackendError, select_backend

    monkeypatch.delenv(ENV_VAR, raising=False)
    cpu = torch.device("cpu")
    # CPU: the fused C++ kernels do not split at the collectives; the PyTorch steps run.
    assert select_backend("auto", cpu, tp_size=2).name == "reference"
    with pytest.raises(StepBackendError, match=r"step backend 'cpu' does not run under tensor"):
        select_backend("cpu", cpu, tp_size=2)
    with pytest.raises(StepBackendError) as refused:
        select_backend("cpu", cpu, tp_size=4)
    assert "\n" not in str(refused.value) and "tp=4" in str(refused.value)
    # CUDA: the Triton kernels split at them (on a faked CUDA device; here asked for, and
    # on CPU tensors under the interpreter as the engine tests run them).
    monkeypatch.setattr(registry, "_cuda_backend_instance", lambda: "cuda backend")
    assert select_backend("auto", torch.device("cuda"), tp_size=2) == "cuda backend"
    assert select_backend("cuda", torch.device("cuda"), tp_size=8) == "cuda backend"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("cuda", cpu, tp_size=2) == "cuda backend"
    assert select_backend("reference", torch.device("cuda"), tp_size=2).name == "reference"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "dp2xtp2"])
def test_tp_training_equals_single_process(corpus, single, tmp_path, layout):
    run_dir = tmp_path / layout
    nproc = 2 if layout == "tp2" else 4
    proc = run_train(corpus, run_dir, *COMMON, "parallel.tp=2", nproc=nproc, timeout=600)
    dp = nproc // 2
    assert f"backend fsdp2, world {nproc}, micro {4 // dp}" in proc.stdout, proc.stdout[-2000:]
    _compare(single, run_dir)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [STATEFUL, ("model=tiny_gpn",)],
    ids=["2-layers-tbptt-carried-state", "gpn-without-memory"],
)
def test_tp2_other_gpn_shapes_equal_single(corpus, tmp_path, overrides):
    ref, run_dir = tmp_path / "single", tmp_path / "tp2"
    run_train(corpus, ref, *COMMON, *overrides)
    run_train(corpus, run_dir, *COMMON, *overrides, "parallel.tp=2", nproc=2)
    _compare(ref, run_dir, overrides)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, nproc",
    [("transformer_pp_tiny", 4), ("gated_deltanet_tiny", 2)],
    ids=["transformer_pp-dp2xtp2", "gated_deltanet-tp2"],
)
def test_baseline_family_under_tp_equals_single_process(corpus, tmp_path, model, nproc):
    """The baselines through the trainer under tp: their blocks on the tp (or dp x tp) mesh,
    their residual norms, embedding and head on dp only (the clipping and norm go mesh by
    mesh); GDN's shared output-norm weight has its gradient summed over the group."""
    family = (f"model={model}",)
    ref, run_dir = tmp_path / "single", tmp_path / "tp"
    run_train(corpus, ref, *COMMON, *family)
    proc = run_train(corpus, run_dir, *COMMON, *family, "parallel.tp=2", nproc=nproc, timeout=600)
    micro = 4 // (nproc // 2)
    assert f"backend fsdp2, world {nproc}, micro {micro}" in proc.stdout, proc.stdout[-2000:]
    _compare(ref, run_dir, family)


# ------------------------------------------------------------------ checkpoints
HEADS4 = (*COMMON, "model_overrides.n_heads=4")  # splits over tp = 4 as well


@pytest.fixture(scope="module")
def tp2_heads4(corpus, once_per_run):
    def build(base):
        run_train(corpus, base / "run", *HEADS4, "parallel.tp=2", nproc=2)

    return once_per_run("tp2_heads4", build) / "run"


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 4])
def test_tp2_checkpoint_resumes_at_another_tp(corpus, tp2_heads4, tmp_path, tp):
    """DCP holds the logical tensors: a tp = 2 checkpoint continues at tp = 1 (one process)
    and at tp = 4 with the uninterrupted run's next losses."""
    ck2 = tp2_heads4 / "checkpoints" / "step_000000002"
    assert ck2.is_dir()
    run_dir = tmp_path / f"tp{tp}"
    args = ("parallel.tp=4",) if tp == 4 else ()
    proc = run_train(corpus, run_dir, *HEADS4, *args, nproc=tp, resume=str(ck2), timeout=600)
    assert "at step 2" in proc.stdout
    ref, got = train_losses(tp2_heads4), train_losses(run_dir)
    assert sorted(got) == [3, 4]
    for s in got:
        assert got[s] == pytest.approx(ref[s], rel=LOSS_RTOL, abs=0), (s, got[s], ref[s])


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += children
            todo += children
    return out


@pytest.mark.slow
def test_kill9_under_tp2_then_resume_auto_reproduces_the_losses(corpus, tp2_heads4, tmp_path):
    import os
    import signal
    import time

    from train_helpers import cli

    run_dir = tmp_path / "run"
    cmd = cli(2) + train_args(corpus, run_dir, *HEADS4, "parallel.tp=2", "debug.step_sleep=3")
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=child_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while max(train_losses(run_dir), default=0) < 3:  # past the step-2 checkpoint
            assert proc.poll() is None and time.time() < deadline, "no step 3"
            time.sleep(0.05)
        # torchrun starts each rank in a session of its own: kill the ranks themselves
        # (a killed agent alone leaves them training on), then the agent.
        ranks = _descendants(proc.pid)
        assert len(ranks) >= 2, ranks
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        deadline = time.time() + 30
        while any(Path(f"/proc/{pid}").exists() for pid in ranks):  # reaped by init
            assert time.time() < deadline, "ranks still alive after SIGKILL"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = run_train(corpus, run_dir, *HEADS4, "parallel.tp=2", nproc=2, resume="auto")
    assert "at step 2" in out.stdout
    ref, got = train_losses(tp2_heads4), train_losses(run_dir)
    assert sorted(got) == list(range(1, TOTAL + 1))
    for s in got:
        assert got[s] == pytest.approx(ref[s], rel=LOSS_RTOL, abs=0), (s, got[s], ref[s])


# ------------------------------------------------------------------ bad configs
def test_model_that_does_not_split_names_the_field():
    from gpn_scale.models.gpn.parallelize import check_tp
    from gpn_scale.testing.models import tiny_config

    check_tp(tiny_config(n_heads=4, d_ffn=24, vocab_size=40), 4)
    with pytest.raises(
        ConfigError, match=r"^model\.n_heads: 2 heads do not split over parallel\.tp=4"
    ):
        check_tp(tiny_config(), 4)
    with pytest.raises(ConfigError, match=r"^model\.d_ffn: 26 does not split over parallel\.tp=4"):
        check_tp(tiny_config(n_heads=4, d_ffn=26), 4)
    check_tp(tiny_config(memory=False, d_ffn=24, vocab_size=40), 8)  # GPN: no heads to split


@pytest.mark.parametrize("name", ["gpn_m_350m", "gpn_m_760m", "gpn_m_1b"])
def test_ladder_from_350m_splits_over_tp8(name):
    from gpn_scale.models.gpn.config import load_model_config
    from gpn_scale.models.gpn.parallelize import check_tp

    cfg = load_model_config(name)
    check_tp(cfg, 8)
    assert cfg.vocab_size % 8 == 0 and cfg.d_state % 8 == 0


def test_sweep_plan_checks_tp_against_each_size(tmp_path):
    from gpn_scale.scaling.sweep import SweepError, expand_sweep

    text = (REPO / "configs" / "sweeps" / "ci.yaml").read_text()
    text = text.replace("checkpoint_root: ../../runs", f"checkpoint_root: {tmp_path}/runs")
    text = text.replace("run_root: ../../runs", f"run_root: {tmp_path}/runs")
    ok = tmp_path / "tp2.yaml"  # tiny: 2 heads, d_ffn 320
    ok.write_text(
        text.replace(
            "  min_lr_ratio: 0.1\n", "  min_lr_ratio: 0.1\n  overrides: [parallel.tp=2]\n", 1
        )
    )
    runs = expand_sweep(ok)
    assert runs and all("parallel.tp=2" in r.train_overrides() for r in runs)
    bad = tmp_path / "tp4.yaml"
    bad.write_text(
        text.replace(
            "  min_lr_ratio: 0.1\n", "  min_lr_ratio: 0.1\n  overrides: [parallel.tp=4]\n", 1
        )
    )
    with pytest.raises(
        SweepError, match=r"overrides: model\.n_heads: 2 heads do not split over parallel\.tp=4"
    ):
        expand_sweep(bad)


def test_live_analyses_under_tp_are_one_line():
    from gpn_scale.run.config import TrainConfig, validate

    cfg = TrainConfig()
    cfg.parallel.tp, cfg.analysis.every_steps = 2, 10
    with pytest.raises(ConfigError, match=r"^analysis\.every_steps: .*gpn-scale analyze"):
        validate(cfg)


def test_world_not_divisible_and_wrong_backend_name_the_field():
    from gpn_scale.core.env import check_world
    from gpn_scale.run.config import TrainConfig, validate

    check_world(4, 2)
    with pytest.raises(ConfigError, match=r"^parallel\.tp: 2 does not divide the world size 3"):
        check_world(3, 2)
    cfg = TrainConfig()
    cfg.parallel.tp, cfg.parallel.backend = 2, "deepspeed"
    with pytest.raises(ConfigError, match=r"^parallel\.tp=2: .* fsdp2"):
        validate(cfg)


def test_launch_check_names_what_does_not_split():
    """`gpn-scale train ... --check-launch NODES PROCS` (what slurm/train.sbatch runs first)."""
    from gpn_scale.run.config import load_train_config
    from gpn_scale.train.preflight import check_launch

    def cfg(*overrides: str):
        return load_train_config("ci_tiny", list(overrides))

    assert check_launch(cfg("parallel.tp=2"), 2, 2) == []
    with pytest.raises(ConfigError, match=r"^parallel\.tp: 2 does not divide the world size 3"):
        check_launch(cfg("parallel.tp=2"), 1, 3)
    with pytest.raises(ConfigError, match=r"^model\.n_heads: 2 heads do not split over parallel"):
        check_launch(cfg("parallel.tp=4", "train.global_batch_size=8"), 1, 4)
    with pytest.raises(ConfigError, match=r"^model_overrides\.d_ffn|^model\.d_ffn"):
        check_launch(cfg("parallel.tp=2", "model_overrides.d_ffn=63"), 1, 2)
    with pytest.raises(ConfigError, match=r"the train micro batch 1 per data-parallel rank"):
        check_launch(cfg("parallel.tp=2", "train.global_batch_size=2"), 1, 4)
    with pytest.raises(ConfigError, match=r"the val micro batch 3 per data-parallel rank"):
        check_launch(cfg("parallel.tp=2", "eval.batch_size=3"), 1, 2)
    for family in ("transformer_pp_tiny", "gated_deltanet_tiny"):
        assert check_launch(cfg("parallel.tp=2", f"model={family}"), 1, 2) == []
    with pytest.raises(ConfigError, match=r"^model\.n_heads: 2 does not split over parallel"):
        check_launch(cfg("parallel.tp=3", "model=gated_deltanet_tiny"), 1, 3)
    (warning,) = check_launch(cfg("parallel.tp=4", "model_overrides.n_heads=4"), 2, 2)
    assert "exceeds the 2 processes per node" in warning


def test_tp_in_one_process_is_one_line(corpus, tmp_path):
    proc = subprocess.run(
        [PY, "-m", "gpn_scale", *train_args(corpus, tmp_path / "run", "parallel.tp=2")],
        cwd=REPO,
        env=child_env(tmp_path),
        text=True,
        capture_output=True,
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("gpn-scale: error: parallel.tp: 2 does not divide the world size 1")
    assert not (tmp_path / "run").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_w1_block_layout_keeps_values_and_loads_flat_state_dicts():
    """W_1 is stored (2, f, d) (its [a | b] halves shard alike); a flat (2f, d) tensor (an
    older model_final.pt) loads into it. (Same values under a seed as the nn.Linear it
    replaced: tests/models/gpn's engine tests, unchanged, hold the same perturbed models.)"""
    from gpn_scale.models.gpn import GPN
    from gpn_scale.testing.models import tiny_config

    cfg = tiny_config()
    torch.manual_seed(0)
    model = GPN(cfg)
    w1 = model.layers[0].ffn.w1
    assert tuple(w1.weight.shape) == (2, cfg.d_ffn, cfg.d_state)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flat = state["layers.0.ffn.w1.weight"].reshape(2 * cfg.d_ffn, cfg.d_state) + 1.0
    state["layers.0.ffn.w1.weight"] = flat
    other = GPN(cfg)
    other.load_state_dict(state)
    assert torch.equal(other.layers[0].ffn.w1.flat(), flat)


def test_a_family_without_a_trainer_tp_plan_is_refused_in_one_line(monkeypatch):
    import dataclasses

    from gpn_scale.models import registry
    from gpn_scale.train import preflight

    spec, cfg = registry.load_model_config("gated_deltanet_tiny")
    planless = dataclasses.replace(spec, name="planless", apply_tp=None)
    monkeypatch.setattr(registry, "family_of", lambda _cfg: planless)
    preflight.check_tensor_parallel(cfg, 1)
    with pytest.raises(ConfigError, match=r"^parallel\.tp=2: the trainer has no tensor-parallel"):
        preflight.check_tensor_parallel(cfg, 2)
