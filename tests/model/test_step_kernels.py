"""The fused CPU step kernels (gpn_scale/ops/csrc/step_kernels.cpp) equal the engine's
PyTorch steps, forward and every gradient, and the choice between them behaves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gpn_scale.model import GPNState, engine
from gpn_scale.ops import step_kernels
from gpn_scale.ops.step_kernels import ENV_VAR, StepKernelError, kernels_for
from gpn_scale.testing.models import perturbed_model, tiny_config

CASES = {
    "1-layer": dict(),
    "2-layer": dict(n_layers=2),
    "3-layer": dict(n_layers=3, chunk_size=5),
    "gpn-no-memory": dict(memory=False),
    "gpn-2-layer": dict(memory=False, n_layers=2),
    "decoder-bias": dict(decoder_bias=True),
    "chunk-1": dict(chunk_size=1),
    "chunk-not-dividing": dict(chunk_size=5),
    "chunk-longer-than-T": dict(chunk_size=64),
    "tbptt": dict(tbptt=5, chunk_size=4),
    "tbptt-2-layer": dict(tbptt=4, n_layers=2, chunk_size=3),
    "wide-heads": dict(n_heads=3, d_key=16, d_value=20, d_state=40, d_ffn=36),
}


def _run(model, tokens, state, path: str, monkeypatch) -> tuple:
    monkeypatch.setenv(ENV_VAR, path)
    out = model(tokens, state=state, return_state=True)
    grads = torch.autograd.grad(out.loss, [*model.parameters(), *(t for t in state if t is not None
                                                                    and t.requires_grad)])
    return out, grads


def _state(cfg, B: int, dtype) -> GPNState:
    """A non-zero initial carry (as in a stateful window) that also receives gradients."""
    g = torch.Generator().manual_seed(7)
    s = torch.randn(B, cfg.d_state, generator=g, dtype=dtype)
    s_prev = torch.randn(B, cfg.d_state, generator=g, dtype=dtype)
    M = (torch.randn(B, cfg.n_heads, cfg.d_key, cfg.d_value, generator=g, dtype=dtype) * 0.3
         if cfg.memory else None)
    return GPNState(*(t.requires_grad_() if t is not None else None for t in (s, s_prev, M)))


def _compare(cfg, dtype, monkeypatch, rtol: float, atol: float, value_tol: float | None = None,
             T: int = 13, B: int = 3) -> None:
    model = perturbed_model(cfg, dtype)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    state = _state(cfg, B, dtype)
    fused, g_fused = _run(model, tokens, state, "cpp", monkeypatch)
    plain, g_plain = _run(model, tokens, state, "python", monkeypatch)
    torch.testing.assert_close(fused.loss, plain.loss, rtol=min(rtol, 1e-5), atol=0)
    for got, want in zip(fused.state, plain.state):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=value_tol or rtol, atol=value_tol or atol)
    names = [n for n, _ in model.named_parameters()] + ["s0", "s_prev0", "M0"]
    for name, got, want in zip(names, g_fused, g_plain):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol + rtol * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_fused_equals_pytorch_steps_float64(case, monkeypatch):
    _compare(tiny_config(**CASES[case]), torch.float64, monkeypatch, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("layers,chunk", [(1, 20), (1, 17), (2, 19)])
def test_fused_equals_pytorch_steps_long_chunks_float64(layers, chunk, monkeypatch):
    """Chunks of several sweep blocks (the reverse sweep defers the history pushes of a block
    of 8 steps onto earlier steps): whole blocks, a partial last block, a block of one step.
    45 steps of a perturbed recurrence amplify float64 rounding to ~1e-11 in the state."""
    _compare(tiny_config(n_layers=layers, chunk_size=chunk), torch.float64, monkeypatch,
             rtol=1e-10, atol=1e-12, value_tol=1e-10, T=45)


@pytest.mark.parametrize("case", ["1-layer", "2-layer", "gpn-no-memory", "tbptt", "wide-heads"])
def test_fused_equals_pytorch_steps_float32(case, monkeypatch):
    # The engine tests' float32 tolerances: loss 1e-5, gradients 1e-5 + 1e-4 relative, state
    # 1e-4 (13 steps of a perturbed recurrence amplify rounding differences).
    _compare(tiny_config(**CASES[case]), torch.float32, monkeypatch, rtol=1e-4, atol=1e-5,
             value_tol=1e-4)


def test_fused_under_bf16_autocast_matches_pytorch_steps(monkeypatch):
    """CPU autocast: both paths run the loop's matmuls in bf16 and the rest in fp32."""
    cfg = tiny_config(n_layers=2, chunk_size=5)
    model = perturbed_model(cfg, torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (3, 13), generator=torch.Generator().manual_seed(3))
    losses = {}
    for path in ("cpp", "python"):
        monkeypatch.setenv(ENV_VAR, path)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(tokens, return_state=True)
        assert out.state.s.dtype == torch.float32 and out.state.memory.dtype == torch.float32
        grads = torch.autograd.grad(out.loss, list(model.parameters()))
        losses[path] = (out.loss, grads)
    torch.testing.assert_close(losses["cpp"][0], losses["python"][0], rtol=1e-4, atol=0)
    for got, want in zip(losses["cpp"][1], losses["python"][1]):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_fused_kernels_serve_cpu_training_by_default(monkeypatch):
    """In the default mode the engine's loop really runs in the kernels (not a silent fallback)."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    module = kernels_for(torch.device("cpu"))
    assert module is not None
    calls = []

    class Spy:
        def __getattr__(self, name):
            def call(*args):
                calls.append(name)
                return getattr(module, name)(*args)
            return call

    monkeypatch.setattr(engine, "kernels_for", lambda device: Spy())
    model = perturbed_model(tiny_config(chunk_size=4), torch.float32)
    model(torch.randint(0, 37, (2, 9))).loss.backward()
    assert calls.count("chunk_forward") == 3 and calls.count("chunk_backward") == 3


def test_python_mode_and_gpu_tensors_use_pytorch_steps(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "python")
    assert kernels_for(torch.device("cpu")) is None
    monkeypatch.setenv(ENV_VAR, "auto")
    assert kernels_for(torch.device("cuda")) is None   # the GPU path keeps its PyTorch steps


def test_bad_mode_is_one_line_error(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(StepKernelError, match=r"GPN_SCALE_STEP_KERNELS='fast': expected one of "
                                              r"auto, cpp, python") as info:
        kernels_for(torch.device("cpu"))
    assert "\n" not in str(info.value)


def _failed_build() -> Exception:
    output = ("[1/2] c++ -c step_kernels.cpp\nFAILED: step_kernels.o\n"
              "step_kernels.cpp:12:10: fatal error: torch/extension.h: No such file or directory\n"
              "ninja: build stopped: subcommand failed.")
    error = RuntimeError(f"Error building extension 'gpn_scale_step_kernels': {output}")
    error.__cause__ = subprocess.CalledProcessError(1, ["ninja", "-v"])
    return error


def test_build_failure_required_is_one_line_error_naming_compiler_error(monkeypatch):
    monkeypatch.setattr(step_kernels, "_load", _failed_build)
    monkeypatch.setenv(ENV_VAR, "cpp")
    with pytest.raises(StepKernelError) as info:
        kernels_for(torch.device("cpu"))
    message = str(info.value)
    assert "\n" not in message
    assert "fatal error: torch/extension.h: No such file or directory" in message
    assert "install g++ and ninja" in message and f"{ENV_VAR}=python" in message


def test_build_failure_in_auto_mode_warns_and_falls_back(monkeypatch):
    monkeypatch.setattr(step_kernels, "_load", _failed_build)
    monkeypatch.setenv(ENV_VAR, "auto")
    step_kernels._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match="could not be built.*using the PyTorch steps"):
        assert kernels_for(torch.device("cpu")) is None
    model = perturbed_model(tiny_config(), torch.float32)
    with pytest.warns(RuntimeWarning):   # the engine still trains, on the PyTorch steps
        step_kernels._warn_once.cache_clear()
        loss = model(torch.randint(0, 37, (2, 9))).loss
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.parametrize("level", ["default", "avx2"])
def test_build_level_follows_torch_dispatch_level(level):
    """ATEN_CPU_CAPABILITY caps torch's own kernels; the step kernels are built no higher (a
    separately named build: nodes of different CPU generations share a build cache)."""
    code = ("from gpn_scale.ops import step_kernels as s; "
            "c = s._capability(); print(c, ' '.join(s._build_flags(c)))")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": level}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    cpu_has_avx2 = {"avx2", "fma"} <= step_kernels._cpu_flags()
    want = "avx2" if level == "avx2" and cpu_has_avx2 else "default"
    assert out[0] == want
    assert f"-DCPU_CAPABILITY={want.upper()}" in out
    assert ("-mavx2" in out) == (want == "avx2") and not any(f.startswith("-mavx512") for f in out)
