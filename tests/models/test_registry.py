"""The family registry and the language-model interface, on the GPN family."""

from __future__ import annotations

import pytest
import torch

from gpn_scale.core.config import ConfigError
from gpn_scale.models.protocol import LanguageModel
from gpn_scale.models.registry import config_from_dict, get_family, load_model_config


def test_a_config_without_family_is_gpn_and_an_explicit_one_round_trips() -> None:
    spec, cfg = load_model_config("tiny")
    assert spec.name == "gpn" and cfg.name == "tiny"
    again_spec, again = config_from_dict({"family": "gpn", **cfg.to_dict()})
    assert again_spec is spec and again == cfg


def test_an_unknown_family_is_one_line_naming_the_closest() -> None:
    with pytest.raises(ConfigError, match=r"unknown family 'gpm'.*did you mean 'gpn'"):
        get_family("gpm")


def test_next_token_logits_is_the_next_position_of_a_longer_forward() -> None:
    spec, cfg = load_model_config("tiny")
    torch.manual_seed(0)
    model = spec.build(cfg).double()
    assert isinstance(model, LanguageModel)
    tokens = torch.randint(0, cfg.vocab_size, (2, 6))
    full = model(tokens, return_logits=True).logits
    state = model(tokens[:, :5], return_state=True).state
    torch.testing.assert_close(model.next_token_logits(state), full[:, 5], rtol=1e-10, atol=1e-10)
