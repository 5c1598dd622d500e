"""`python -m gpn_scale.bench.engine --reference-jax PATH`: the paper's JAX implementation
driven beside the engine. Smoke tests on tiny shapes; they need jax/flax/optax (the `jax`
extra) and a checkout of github.com/steve-z-wang/grounded-prediction-network named by
GPN_REFERENCE_JAX, and are skipped without them (the bad-checkout test runs always)."""

from __future__ import annotations

import os

import pytest
import torch

from gpn_scale.bench import engine as engine_bench
from gpn_scale.bench import reference_jax
from gpn_scale.models.gpn import GPN, load_model_config

CHECKOUT = os.environ.get("GPN_REFERENCE_JAX", "")


@pytest.fixture
def checkout() -> str:
    pytest.importorskip("jax")
    pytest.importorskip("flax")
    pytest.importorskip("optax")
    if not (CHECKOUT and os.path.isfile(os.path.join(CHECKOUT, reference_jax.MODEL_FILE))):
        pytest.skip(
            "set GPN_REFERENCE_JAX to a checkout of the paper's code "
            "(git clone https://github.com/steve-z-wang/grounded-prediction-network)"
        )
    return CHECKOUT


@pytest.mark.parametrize("config", ["tiny", "tiny_2l"])
def test_the_jax_model_is_ours_at_the_same_weights(checkout: str, config: str) -> None:
    torch.manual_seed(0)
    model = GPN(load_model_config(config))
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        ours = float(model(tokens).loss)
    theirs = reference_jax.reference_loss(checkout, model, tokens.numpy())
    assert theirs == pytest.approx(ours, rel=1e-5)


def test_speed_table_times_the_jax_trainer_alternating(checkout: str) -> None:
    order: list[str] = []
    rows = engine_bench.bench_speed(2, checkout, shapes={"TINY": ("tiny", 2, 16)})
    assert len(rows) == 1 and rows[0]["jax"] > 0 and rows[0]["ratio_jax"] > 0
    torch.manual_seed(0)
    model = GPN(load_model_config("tiny"))
    tokens = torch.randint(0, model.config.vocab_size, (2, 16)).numpy()
    seconds = reference_jax.train_steps(
        checkout, model, tokens, 3, between=lambda step: order.append(f"ours{step}")
    )
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert order == ["ours0", "ours1", "ours2"]


def test_a_bad_checkout_is_one_line_naming_where_to_get_it(tmp_path, capsys) -> None:
    assert engine_bench.main(["--only", "speed", "--reference-jax", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(tmp_path) in err
    assert "git clone https://github.com/steve-z-wang/grounded-prediction-network" in err
