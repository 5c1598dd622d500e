"""`python -m gpn_scale.accounting.tp_model`: the tensor-parallel step-time prediction's parts."""

from __future__ import annotations

import pytest

from gpn_scale.accounting import tp_model
from gpn_scale.models.gpn import load_model_config


@pytest.fixture(scope="module")
def ladder_1b():
    return load_model_config("gpn_m_1b")


def test_all_reduces_per_step_follow_the_collective_points(ladder_1b):
    """Three per layer and step for GPN+M (collectives.py: (1)+(2) forward in one buffer, (3)
    and (4) backward), two for GPN; none at tp 1."""
    rows = {r.tp: r for r in tp_model.tp_table(ladder_1b, 16, 2048, "h200")}
    assert sorted(rows) == [1, 2, 4, 8]
    assert rows[1].allreduces_per_step == 0
    assert all(rows[t].allreduces_per_step == 3 * ladder_1b.n_layers for t in (2, 4, 8))
    gpn = load_model_config("gpn_1b")
    assert tp_model.tp_table(gpn, 16, 2048, "h200")[-1].allreduces_per_step == 2 * gpn.n_layers


def test_vocab_parallel_decode_costs_the_tp1_logits_plus_the_replicated_projection(ladder_1b):
    cfg = ladder_1b
    assert tp_model.decode_seconds(cfg, 1, 16, 2048, 0.5) == 0.5
    at8 = tp_model.decode_seconds(cfg, 8, 16, 2048, 0.5)
    compute = 0.5 * (8 * cfg.d_state + cfg.vocab_size) / (cfg.d_state + cfg.vocab_size)
    assert compute < at8 < compute + 0.1  # + two (rows x e) all-reduces over NVLink
    assert at8 < 8 * 0.5  # never the replicated decode's tp x rows x V


def test_sequential_part_shrinks_with_tp_and_the_chunk_wide_part_does_not(ladder_1b):
    rows = tp_model.tp_table(ladder_1b, 16, 2048, "h200")
    seq = [r.step_seconds["sequential"] for r in rows]
    chunk = {round(r.step_seconds["chunk-wide"], 12) for r in rows}
    assert seq == sorted(seq, reverse=True) and len(chunk) == 1


def test_cli_prints_the_table_and_names_a_bad_config(capsys):
    assert tp_model.main(["gpn_m_130m", "--set", "n_heads=16", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "| h200 | replicated | 8 | 128 |" in out and "decode s" in out
    assert tp_model.main(["no_such_model"]) == 2
    assert "no_such_model" in capsys.readouterr().err
