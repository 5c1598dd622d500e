"""Transformer++: the interface's alignment, the KV-cache state, counts vs a counted forward."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from gpn_scale.core.config import ConfigError
from gpn_scale.models.protocol import LanguageModel
from gpn_scale.models.registry import config_from_dict, load_model_config
from gpn_scale.models.transformer_pp.counts import forward_flops_per_token

SMALL = dict(family="transformer_pp", vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ffn=48)


def _model(dtype=torch.float64, **changes):
    spec, cfg = config_from_dict({**SMALL, **changes})
    torch.manual_seed(0)
    return spec, cfg, spec.build(cfg).to(dtype)


def test_the_shipped_configs_load_and_round_trip_through_the_registry() -> None:
    spec, cfg = load_model_config("transformer_pp_130m")
    assert spec.name == "transformer_pp" and (cfg.n_layers, cfg.d_model) == (12, 768)
    assert config_from_dict(cfg.to_dict()) == (spec, cfg)  # what a checkpoint saves
    for size in ("tiny", "10m", "25m", "50m", "350m", "760m", "1b"):
        assert load_model_config(f"transformer_pp_{size}")[0] is spec


@pytest.mark.parametrize(
    "change, message",
    [
        ({"d_modle": 32}, r"model.d_modle: unknown key .*did you mean 'd_model'"),
        ({"n_heads": 5}, r"model.n_heads: 5 does not divide d_model=32"),
        ({"n_heads": 32}, r"model.n_heads: head width .* is odd"),
        ({"tie_embeddings": "yes"}, r"model.tie_embeddings: expected true or false"),
        ({"tbptt": 8}, r"model.tbptt: unknown key for family transformer_pp"),
    ],
)
def test_bad_configs_are_one_line(change, message) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        config_from_dict({**SMALL, **change})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_is_exact_and_the_embedding_has_the_start_row(tied) -> None:
    spec, cfg, model = _model(tie_embeddings=tied)
    assert model.num_parameters() == spec.count_parameters(cfg)
    assert model.embed.weight.shape[0] == cfg.vocab_size + 1
    assert (model.head is None) == tied
    spec130, cfg130 = load_model_config("transformer_pp_130m")
    with torch.device("meta"):
        assert spec130.build(cfg130).num_parameters() == spec130.count_parameters(cfg130)


@pytest.mark.parametrize("tied", [False, True])
def test_a_cached_continuation_equals_the_full_forward(tied) -> None:
    _, cfg, model = _model(tie_embeddings=tied)
    assert isinstance(model, LanguageModel)
    tokens = torch.randint(0, cfg.vocab_size, (3, 12))
    full = model(tokens, return_logits=True)
    first = model(tokens[:, :5], return_state=True, return_logits=True)
    second = model(tokens[:, 5:], first.state, return_state=True, return_logits=True)
    both = torch.cat([first.logits, second.logits], dim=1)
    torch.testing.assert_close(both, full.logits, rtol=1e-10, atol=1e-10)
    assert second.state.length == 12 and second.state.keys[0].shape[2] == 12
    # One step against the cache is the next position of a longer forward.
    state = model(tokens[:, :11], return_state=True).state
    torch.testing.assert_close(
        model.next_token_logits(state), full.logits[:, 11], rtol=1e-10, atol=1e-10
    )
    # And token-at-a-time from the initial state reproduces position 0 (the start token).
    fresh = model.initial_state(3)
    torch.testing.assert_close(
        model.next_token_logits(fresh), full.logits[:, 0], rtol=1e-10, atol=1e-10
    )


def test_logits_at_t_see_only_tokens_before_t() -> None:
    _, cfg, model = _model()
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    changed = tokens.clone()
    changed[:, 5] = (changed[:, 5] + 1) % cfg.vocab_size
    a = model(tokens, return_logits=True).logits
    b = model(changed, return_logits=True).logits
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=0)  # t <= 5 predicts from < t
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-6
    loss = torch.nn.functional.cross_entropy(a.reshape(-1, cfg.vocab_size), tokens.reshape(-1))
    torch.testing.assert_close(model(tokens).loss, loss)  # every position scored


@pytest.mark.parametrize("tied", [False, True])
def test_flop_counts_match_a_counted_forward_and_backward(tied) -> None:
    """The math SDPA backend: FlopCounterMode has no formula for CPU's fused attention op,
    and the math form runs the same two (T x T) batched matmuls the count credits."""
    spec, cfg, model = _model(torch.float32, tie_embeddings=tied)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    # no_grad: with gradients on, the head's loss forms its gradient matmuls in the forward
    # pass (models/linear_cross_entropy.py); the training count below holds them.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fwd, torch.no_grad():
        model(tokens)
    assert fwd.get_total_flops() == forward_flops_per_token(cfg, 12) * tokens.numel()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as train:
        model(tokens).loss.backward()
    assert train.get_total_flops() == spec.flops_per_token(cfg, 12) * tokens.numel()


def test_fsdp_units_are_the_blocks_and_the_state_detaches() -> None:
    spec, cfg, model = _model()
    assert spec.fsdp_units(model) == list(model.layers) and not spec.recurrent
    tokens = torch.randint(0, cfg.vocab_size, (2, 6))
    state = model(tokens, return_state=True).state
    assert state.keys[0].requires_grad and not state.detach().keys[0].requires_grad


def test_info_prints_the_family_and_its_counts(capsys) -> None:
    from gpn_scale.cli import main

    assert main(["info", "transformer_pp_130m", "--seq-len", "2048"]) == 0
    out = capsys.readouterr().out
    spec, cfg = load_model_config("transformer_pp_130m")
    assert "transformer_pp_130m (transformer_pp, 12 layer(s))" in out
    assert f"{spec.count_parameters(cfg):,}" in out and "134,106,624" in out
    assert f"{spec.flops_per_token(cfg, 2048):.4g}" in out
