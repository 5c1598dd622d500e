"""Reference-format import/export, and the reference initialisation statistics."""

import math
import pickle

import numpy as np
import pytest
import torch

from gpn_scale.models.gpn import GPN, ConfigError
from gpn_scale.models.gpn.reference_format import (
    export_reference,
    import_reference,
    load_reference_params,
)
from gpn_scale.testing.models import perturbed_model, tiny_config


@pytest.mark.parametrize(
    "changes",
    [dict(), dict(n_layers=2, decoder_bias=True), dict(memory=False)],
    ids=["gpn+m", "2-layer-bias", "gpn"],
)
def test_round_trip(changes):
    cfg = tiny_config(**changes)
    model = perturbed_model(cfg, torch.float32)
    exported = export_reference(model)
    # Layout facts of the reference: matrices (in, out), head-major, names per family.
    assert exported["fuse_proj_k"].shape == (cfg.d_emb, cfg.d_state)
    if cfg.memory:
        assert exported["write_W_k_k"].shape == (cfg.d_state, cfg.n_heads * cfg.d_key)
        assert exported["L0_read_W_o_k"].shape == (cfg.n_heads * cfg.d_value, cfg.d_state)
    else:
        assert "ffn_w1_k" in exported and not any(k.startswith("L0_") for k in exported)
    assert ("decode_bias" in exported) == cfg.decoder_bias
    imported = import_reference(exported, chunk_size=cfg.engine.chunk_size)
    assert imported.config.replace(name="") == cfg.replace(name="")
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), imported.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    again = export_reference(imported)
    assert sorted(again) == sorted(exported)
    for name in exported:
        np.testing.assert_array_equal(again[name], exported[name])
    tokens = torch.randint(0, cfg.vocab_size, (2, 6))
    torch.testing.assert_close(imported(tokens).loss, model(tokens).loss, rtol=0, atol=0)


def test_import_rejects_incomplete_or_foreign_mappings():
    exported = export_reference(perturbed_model(tiny_config(), torch.float32))
    missing = dict(exported)
    del missing["write_W_v_k"]
    with pytest.raises(ConfigError, match="write_W_v_k.*missing"):
        import_reference(missing)
    extra = dict(exported, transformer_wq=np.zeros((2, 2), np.float32))
    with pytest.raises(ConfigError, match="transformer_wq"):
        import_reference(extra)
    bad = dict(exported, L0_ffn_w2_k=np.zeros((3, 3), np.float32))
    with pytest.raises(ConfigError, match="L0_ffn_w2_k"):
        import_reference(bad)


def test_load_reference_checkpoint_pickle_and_npz(tmp_path):
    exported = export_reference(perturbed_model(tiny_config(), torch.float32))
    np.savez(tmp_path / "p.npz", **exported)
    for name, value in load_reference_params(tmp_path / "p.npz").items():
        np.testing.assert_array_equal(value, exported[name])
    ckpt = tmp_path / "run"
    ckpt.mkdir()
    with open(ckpt / "checkpoint.pkl", "wb") as fh:
        pickle.dump(
            {"step": 3, "params": exported, "opt_state": ({"mu": exported["fg_gate_b"]},)}, fh
        )
    loaded = load_reference_params(ckpt)
    assert sorted(loaded) == sorted(exported)


class _Evil:
    def __reduce__(self):
        return (open, ("/tmp/gpn_scale_pwned_by_pickle", "w"))


def test_reference_pickle_cannot_run_code(tmp_path):
    path = tmp_path / "checkpoint.pkl"
    with open(path, "wb") as fh:
        pickle.dump({"params": {"embedding": np.zeros((2, 2))}, "x": _Evil()}, fh)
    target = "/tmp/gpn_scale_pwned_by_pickle"
    import os

    if os.path.exists(target):
        os.remove(target)
    load_reference_params(path)
    assert not os.path.exists(target)


def test_reference_initialisation_statistics():
    torch.manual_seed(0)
    cfg = tiny_config(
        vocab_size=4000,
        d_state=256,
        d_emb=128,
        d_ffn=384,
        n_heads=64,
        d_key=8,
        d_value=8,
        n_layers=2,
        decoder_bias=True,
    )
    ref = export_reference(GPN(cfg))
    zeros = ["fg_gate_k", "fg_gate_b", "write_W_k_b", "decode_bias"]
    for i in range(2):
        zeros += [f"L{i}_ffn_w2_k", f"L{i}_pg_gate_k", f"L{i}_pg_gate_b", f"L{i}_read_W_q_b"]
    for name in zeros:
        assert not ref[name].any(), name
    for name, value in ref.items():
        if name.endswith("norm_w"):
            assert (value == 1).all(), name
    assert abs(ref["embedding"].std() - 0.02) < 1e-3 and abs(ref["embedding"].mean()) < 1e-3
    assert abs(ref["L0_read_W_o_k"].std() - 0.02) < 2e-3
    lecun = [
        "decode_proj_k",
        "fuse_proj_k",
        "write_W_k_k",
        "write_W_v_k",
        "write_W_beta_k",
        "write_W_a_k",
        "L0_ffn_w1_k",
        "L0_read_W_q_k",
        "L0_read_W_gate_k",
    ]
    for name in lecun:
        w = ref[name]
        std = 1 / math.sqrt(w.shape[0])  # fan_in = rows of an (in, out) matrix
        assert abs(w.std() / std - 1) < 0.1, name
        assert np.abs(w).max() <= 2 * std / 0.8796 + 1e-6, name  # truncated at 2 sd
    A = np.exp(ref["write_A_log"])
    assert (A > 0).all() and (A <= 16).all() and A.max() > 8 and A.min() < 8
    dt = np.log1p(np.exp(ref["write_dt_bias"]))  # softplus undoes the inverse softplus
    assert (dt >= 1e-4 * 0.999).all() and (dt <= 0.1 * 1.001).all()
    assert dt.min() < 0.01 < dt.max()
