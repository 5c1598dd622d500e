"""The sequence engine equals the slow reference path (loss, logits, every gradient, state)."""

import pytest
import torch

from gpn_scale.models.gpn import GPNState
from gpn_scale.models.gpn.reference import reference_forward
from gpn_scale.ops.gpn_step.step_kernels import ENV_VAR
from gpn_scale.testing.models import gpn_cases, perturbed_model, tiny_config

CASES = gpn_cases(
    "1-layer",
    "2-layer",
    "gpn-no-memory",
    "decoder-bias",
    "chunk-divides-T",
    "chunk-not-dividing",
    "chunk-1",
    "chunk-longer-than-T",
    "tbptt",
    "tbptt-2-layer",
    "loss-in-small-chunks",
)


def _compare(
    cfg, dtype, T=12, B=3, rtol=1e-9, grad_atol=0.0, grad_rtol=1e-9, loss_rtol=None, value_tol=None
):
    model = perturbed_model(cfg, dtype)
    tokens = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    params = list(model.parameters())
    out = model(tokens, return_state=True, return_logits=True)
    ref = reference_forward(model, tokens, return_state=True, return_logits=True)
    torch.testing.assert_close(out.loss, ref.loss, rtol=loss_rtol or rtol, atol=0)
    value_tol = value_tol or rtol
    torch.testing.assert_close(out.logits, ref.logits, rtol=value_tol, atol=value_tol)
    for got, want in zip(out.state, ref.state):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=value_tol, atol=value_tol)
    g_out = torch.autograd.grad(out.loss, params)
    g_ref = torch.autograd.grad(ref.loss, params)
    names = [n for n, _ in model.named_parameters()]
    for name, got, want in zip(names, g_out, g_ref):
        scale = want.abs().max().item()
        torch.testing.assert_close(
            got,
            want,
            rtol=grad_rtol,
            atol=grad_atol + grad_rtol * scale,
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.parametrize("steps", ["cpp", "python"])
@pytest.mark.parametrize("case", CASES)
def test_engine_equals_reference_float64(case, steps, monkeypatch):
    # Both forms of the loop's steps: the fused CPU kernels and the PyTorch ops (GPU's form).
    monkeypatch.setenv(ENV_VAR, steps)
    _compare(tiny_config(**CASES[case]), torch.float64)


@pytest.mark.parametrize(
    "case", ["1-layer", "2-layer", "gpn-no-memory", "decoder-bias", "chunk-not-dividing", "tbptt"]
)
def test_engine_equals_reference_float32(case):
    # Loss and gradients at the tolerances; logits/state (not specified there) at 1e-4.
    _compare(
        tiny_config(**CASES[case]),
        torch.float32,
        rtol=1e-5,
        loss_rtol=1e-5,
        grad_atol=1e-5,
        grad_rtol=1e-4,
        value_tol=1e-4,
    )


@pytest.mark.parametrize("n_layers", [1, 2])
def test_state_carried_across_two_windows(n_layers):
    """Window 2 starts from window 1's final carry; gradients flow back through both."""
    cfg = tiny_config(n_layers=n_layers, chunk_size=3)
    model = perturbed_model(cfg)
    gen = torch.Generator().manual_seed(5)
    w1, w2 = (torch.randint(0, cfg.vocab_size, (2, 7), generator=gen) for _ in range(2))
    params = list(model.parameters())

    def run(forward):
        a = forward(model, w1, None)
        b = forward(model, w2, a.state)
        return a.loss + b.loss, b.state

    loss, state = run(lambda m, t, s: m(t, s, return_state=True))
    loss_ref, state_ref = run(lambda m, t, s: reference_forward(m, t, s, return_state=True))
    torch.testing.assert_close(loss, loss_ref, rtol=1e-10, atol=0)
    for got, want in zip(state, state_ref):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    for got, want in zip(torch.autograd.grad(loss, params), torch.autograd.grad(loss_ref, params)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_gradient_reaches_the_initial_state():
    cfg = tiny_config(chunk_size=3)
    model = perturbed_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    init = GPNState(
        *(
            torch.randn(t.shape, generator=gen, dtype=torch.float64).requires_grad_()
            for t in model.initial_state(2)
        )
    )
    got = torch.autograd.grad(model(tokens, init).loss, list(init))
    want = torch.autograd.grad(reference_forward(model, tokens, init).loss, list(init))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-13)


def test_gradcheck_tiny_model():
    """Finite differences against the engine's hand-assembled backward (float64)."""
    cfg = tiny_config(
        vocab_size=11, d_state=6, d_emb=4, d_ffn=5, d_key=3, d_value=3, n_layers=2, chunk_size=2
    )
    model = perturbed_model(cfg, scale=0.3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    names = [n for n, _ in model.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in model.parameters())

    def loss_of(*flat):
        return torch.func.functional_call(model, dict(zip(names, flat)), (tokens,)).loss

    assert torch.autograd.gradcheck(loss_of, params, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_eval_without_grad_matches_training_forward():
    cfg = tiny_config(chunk_size=5)
    model = perturbed_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        loss_eval = model(tokens).loss
    torch.testing.assert_close(loss_eval, model(tokens).loss, rtol=0, atol=0)


def test_bf16_autocast_keeps_state_and_memory_float32():
    cfg = tiny_config(chunk_size=4)
    model = perturbed_model(cfg, dtype=torch.float32, scale=0.1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(6))
    full = model(tokens).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(tokens, return_state=True)
    assert out.state.s.dtype == torch.float32 and out.state.memory.dtype == torch.float32
    assert out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss, full, rtol=3e-2, atol=0)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_position_zero_contributes_log_vocab():
    """At the start all state is zero: logits are zero, so position 0 costs log V."""
    cfg = tiny_config()
    model = perturbed_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 3))
    out = model(tokens, return_logits=True)
    assert torch.count_nonzero(out.logits[:, 0]) == 0


def test_rejects_bad_token_shape():
    model = perturbed_model(tiny_config())
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(5, dtype=torch.long))


def _random_state(model, B: int) -> GPNState:
    """A non-zero carry entering the window: the first chunk's M0 has something to round."""
    gen = torch.Generator().manual_seed(6)
    return GPNState(
        *(
            (torch.randn(t.shape, generator=gen, dtype=torch.float64) * 0.5).requires_grad_()
            for t in model.initial_state(3)
        )
    )


@pytest.mark.parametrize("steps", ["cpp", "python"])
@pytest.mark.parametrize("case", ["1-layer", "2-layer", "chunk-not-dividing", "tbptt"])
def test_bf16_memory_reads_equal_the_reference_that_rounds_each_chunks_m0(case, steps, monkeypatch):
    """engine.bf16_memory_reads: the engine (both forms of its steps) computes what the
    step-by-step reference computes with the reads of each chunk's M0 rounded to bf16, and
    M0's gradient passed through the rounding; the loss is not the exact model's."""
    monkeypatch.setenv(ENV_VAR, steps)
    cfg = tiny_config(**CASES[case], bf16_memory_reads=True)
    model = perturbed_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (3, 12), generator=torch.Generator().manual_seed(3))
    state = _random_state(model, 3)
    wrt = [*model.parameters(), *state]
    out = model(tokens, state, return_state=True)
    ref = reference_forward(model, tokens, state, return_state=True)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-10, atol=0)
    for got, want in zip(out.state, ref.state):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    for got, want in zip(torch.autograd.grad(out.loss, wrt), torch.autograd.grad(ref.loss, wrt)):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12 * max(1.0, scale))
    # The option is on: the exact model's loss differs by about bf16's rounding.
    model.config = cfg.replace(bf16_memory_reads=False)
    exact = reference_forward(model, tokens, state).loss
    assert 1e-9 < abs((exact - out.loss) / exact).item() < 1e-2
