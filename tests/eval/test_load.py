"""gpn_scale/eval/load.py: every kind of checkpoint reference loads the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from gpn_scale.core.config import ConfigError
from gpn_scale.eval.load import load
from gpn_scale.testing.models import perturbed_model, tiny_config


def _same_logits(a: torch.nn.Module, b: torch.nn.Module) -> None:
    x = torch.randint(0, 257, (2, 6), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(a(x, return_logits=True).logits, b(x, return_logits=True).logits)


def test_a_step_dir_a_root_and_a_run_dir_load_the_saved_model(
    checkpoint: str, byte_model: torch.nn.Module
) -> None:
    run_dir = Path(checkpoint).parents[1]
    for ref in (checkpoint, str(run_dir / "checkpoints"), str(run_dir)):
        loaded = load(ref, device="cpu")
        assert loaded.checkpoint == checkpoint and loaded.step == 7
        assert loaded.spec.name == "gpn" and loaded.config == byte_model.config
        assert loaded.tokenizer.kind == "byte" and not loaded.model.training
        _same_logits(loaded.model, byte_model)


def test_model_final_pt_with_an_explicit_model_config(
    tmp_path: Path, byte_model: torch.nn.Module
) -> None:
    path = tmp_path / "model_final.pt"
    torch.save(byte_model.state_dict(), path)
    cfg_yaml = tmp_path / "m.yaml"
    cfg_yaml.write_text(yaml.safe_dump(byte_model.config.to_dict()))
    with pytest.raises(ConfigError, match="no config.yaml beside it"):
        load(str(path), device="cpu")
    loaded = load(str(path), device="cpu", model_config=str(cfg_yaml), tokenizer="byte")
    _same_logits(loaded.model, byte_model)


def test_a_model_trained_reading_its_memory_in_bf16_loads_as_the_exact_model(
    tmp_path: Path,
) -> None:
    """engine.bf16_memory_reads is a training-speed option: evaluation, generation and
    export run the exact model (the family's `for_inference`)."""
    trained = tiny_config(vocab_size=257, bf16_memory_reads=True)
    model = perturbed_model(trained, dtype=torch.float32, scale=0.3).eval()
    path = tmp_path / "model_final.pt"
    torch.save(model.state_dict(), path)
    cfg_yaml = tmp_path / "m.yaml"
    cfg_yaml.write_text(yaml.safe_dump(trained.to_dict()))
    loaded = load(str(path), device="cpu", model_config=str(cfg_yaml), tokenizer="byte")
    exact = trained.replace(bf16_memory_reads=False)
    assert loaded.config == exact == loaded.model.config
    model.config = exact
    _same_logits(loaded.model, model)


def test_missing_references_and_untrusted_tokenizers_are_one_line_errors(
    tmp_path: Path, checkpoint: str
) -> None:
    with pytest.raises(ConfigError, match="no such file or directory"):
        load(str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        load(str(tmp_path / "data"), device="cpu")
    with pytest.raises(ConfigError, match="not found"):
        load(checkpoint, device="cpu", tokenizer=str(tmp_path / "missing.json"))
