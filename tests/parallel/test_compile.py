"""`compile.enable` (gpn_scale/parallel/compile.py): torch.compile of each block of the
Transformer++ and Gated DeltaNet, applied after tensor parallelism and before FSDP2 / ZeRO,
in place (same module paths and state-dict keys); GPN / GPN+M refuse the key in one line.

The trainer runs compile for real on CPU (inductor's C++ backend, g++) with its cache in
the test's own directory (TORCHINDUCTOR_CACHE_DIR), so xdist workers share nothing."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from train_helpers import child_env, grad_norms, run_train, train_losses

from gpn_scale.cli import main
from gpn_scale.core.config import ConfigError
from gpn_scale.models.registry import get_family, load_model_config
from gpn_scale.parallel.train_module import FSDP2TrainModule, ParallelPlan, build_train_module
from gpn_scale.run.config import load_train_config
from gpn_scale.run.model import model_config

BASELINES = ["transformer_pp_tiny", "gated_deltanet_tiny"]
# Compiled and eager float32 differ by reduction order only (inductor fuses the norms,
# RoPE, SiLU and the chunkwise op's elementwise terms): measured <= 1e-7 relative over 3-4
# steps on both tiny models. 1e-5 is ~100 float32 ulps, the bound the suite uses for "the
# same losses, computed another way" (test_checkpoint_from_main's other engine options);
# a wrong graph (a dropped carry, a wrong decay) moves the first step's loss by far more.
LOSS_RTOL = 1e-5
ONE_PROCESS: Any = SimpleNamespace(tp_size=1)  # the Topology fields build_train_module reads


def _plan(strategy: str = "none", compile: bool = True) -> ParallelPlan:
    return ParallelPlan(strategy, 1, 1, 1, grad_clip=1.0, bf16=False, compile=compile)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("name", BASELINES)
def test_the_compile_step_compiles_exactly_the_blocks_in_place(name):
    spec, cfg = load_model_config(name)
    model = spec.build(cfg)
    keys = list(model.state_dict())
    lines: list[str] = []
    build_train_module(
        model,
        _plan(),
        ONE_PROCESS,
        make_optimizer=_sgd,
        compile_blocks=spec.compile_blocks(model),
        compile_fullgraph=spec.compile_fullgraph,
        log=lines.append,
    )
    # nn.Module.compile sets _compiled_call_impl (compiled lazily, at the first call).
    compiled = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None)]
    assert compiled == list(model.layers) and len(compiled) == cfg.n_layers
    assert list(model.state_dict()) == keys  # no _orig_mod.: the same checkpoints
    block = type(model.layers[0]).__name__
    graphs = "one graph each" if name.startswith("transformer") else "graph breaks allowed"
    assert lines == [
        f"compile: torch.compile on each of 2 {block} blocks ({graphs}); the first step "
        "compiles them"
    ]
    # Gated DeltaNet's blocks may break the graph: fla's CUDA op is torch.compiler.disable'd.
    assert spec.compile_fullgraph is name.startswith("transformer")
    untouched = spec.build(cfg)
    build_train_module(untouched, _plan(compile=False), ONE_PROCESS, make_optimizer=_sgd)
    assert not [m for m in untouched.modules() if getattr(m, "_compiled_call_impl", None)]


def test_compile_comes_after_tp_and_before_fsdp2(monkeypatch):
    """torchtitan's order: the graph sees the tp shards, FSDP2's units wrap the compiled blocks."""
    from gpn_scale.parallel import compile as compile_mod
    from gpn_scale.parallel import fsdp

    calls: list[str] = []
    monkeypatch.setattr(compile_mod, "apply_compile", lambda *a, **k: calls.append("compile"))
    monkeypatch.setattr(fsdp, "apply_fsdp2", lambda *a, **k: calls.append("fsdp2"))
    model = nn.Linear(2, 2)
    train_module = build_train_module(
        model,
        _plan("fsdp2"),
        SimpleNamespace(tp_size=2, tp_mesh="tp", dp_mesh="dp"),
        make_optimizer=_sgd,
        apply_tp=lambda m, mesh: calls.append(f"tp on {mesh}"),
        compile_blocks=[model],
    )
    assert calls == ["tp on tp", "compile", "fsdp2"]
    assert isinstance(train_module, FSDP2TrainModule)


def test_gpn_refuses_compile_enable_in_one_line(tmp_path, capsys):
    spec = get_family("gpn")
    assert spec.compile_blocks is None  # its engine runs its own kernels
    cfg = load_train_config("ci_tiny", ["compile.enable=true"])
    with pytest.raises(ConfigError) as err:
        model_config(cfg)
    assert str(err.value) == (
        "compile.enable: model=tiny is family gpn, whose sequence engine runs its own kernels "
        "and is not compiled; compile.enable is for transformer_pp, gated_deltanet; set "
        "compile.enable=false (in a sweep, set it on those families' entries only)"
    )
    model_config(load_train_config("ci_tiny", ["compile.enable=false"]))  # the default
    run_dir = tmp_path / "run"
    assert main(["train", "ci_tiny", f"run_dir={run_dir}", "compile.enable=true"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("gpn-scale: error: compile.enable: ")
    assert not run_dir.exists()
    with pytest.raises(ConfigError, match=r"^compile.enable: ZeRO-3 .* use parallel.zero_stage"):
        load_train_config(
            "ci_tiny",
            ["compile.enable=true", "parallel.backend=deepspeed", "parallel.zero_stage=3"],
        )
    with pytest.raises(ConfigError, match="this model declares no blocks to compile"):
        build_train_module(nn.Linear(2, 2), _plan(), ONE_PROCESS, make_optimizer=_sgd)


# Gated DeltaNet at chunk_size 32: two chunks of the 64-token windows, so the memory carried
# from one chunk to the next is inside the compiled graph; the tiny config's four chunks of
# 16 double the compile (~65 s against ~34 s for the first step, one CPU thread).
TRAINED = [("transformer_pp_tiny",), ("gated_deltanet_tiny", "model_overrides.chunk_size=32")]


@pytest.mark.slow  # the first compiled step: ~20 s (Transformer++), ~35 s (Gated DeltaNet)
@pytest.mark.parametrize("model", TRAINED, ids=[m[0] for m in TRAINED])
def test_compiled_blocks_train_to_the_eager_losses(corpus, tmp_path, model):
    import torch.distributed.checkpoint as dcp

    env = child_env(tmp_path, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    common = (f"model={model[0]}", *model[1:], "schedule.total_steps=3")
    common += ("checkpoint.every_steps=0",)
    common += ("eval.at_end=false",)  # a no-grad forward would compile a second graph
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    run_train(corpus, eager, *common, env=env)
    proc = run_train(corpus, compiled, *common, "compile.enable=true", env=env)
    assert "compile: torch.compile on each of 2 " in proc.stdout + proc.stderr
    assert any((tmp_path / "inductor").iterdir())  # inductor ran, in the test's own cache
    want, got = train_losses(eager), train_losses(compiled)
    assert sorted(want) == [1, 2, 3]
    assert got == pytest.approx(want, rel=LOSS_RTOL)
    assert grad_norms(compiled) == pytest.approx(grad_norms(eager), rel=LOSS_RTOL)

    def keys(run):
        step = run / "checkpoints" / "step_000000003"
        return set(dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata)

    assert keys(compiled) == keys(eager)  # compiled in place: the same checkpoint
