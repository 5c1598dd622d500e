"""The vocabulary-parallel embedding, decoder and loss (parallel.tp > 1), on CPU with gloo.

One launch of 4 real processes (`vocab_parallel_worker.py`) holds, at tp = 4 and tp = 2:
the tp form of `chunked_decode_cross_entropy` equals the one-process op (loss and every
gradient: P, norm, W_dec, bias, each rank's rows of E) in float64 with a block size that
divides the positions and one that does not, and with bf16 matmuls; the loss is the same on
every rank; no tensor the call produces (forward or backward) has a vocabulary dimension
above V/tp, while the one-process op's has V (so the check can fail); the lookup and the
gathered logits equal the full ones. The model-level equality (sharded E inside the
engine, the trainer, checkpoints across tp) is in test_tensor_parallel.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from train_helpers import PY, REPO, child_env

from gpn_scale.core.config import ConfigError


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vocab_parallel")
    out = tmp / "results.json"
    worker = Path(__file__).with_name("vocab_parallel_worker.py")
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
    proc = subprocess.run(
        [*cmd, str(worker), str(out)],
        cwd=REPO,
        env=child_env(tmp),
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"results written: {out.exists()}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def _loss_cases(results):
    for rank, per_rank in enumerate(results):
        for case, r in per_rank.items():
            if "errors" in r:
                yield rank, case, r


def test_vocab_parallel_loss_equals_the_full_loss_and_every_gradient(results):
    cases = list(_loss_cases(results))
    assert len(cases) == 4 * 6  # 4 ranks x (tp 4, tp 2) x (rows 6, rows 5, bf16)
    for rank, case, r in cases:
        tol = 2e-2 if "bf16" in case else 1e-12
        assert len(r["errors"]) == 7, case
        for what, err in r["errors"].items():
            assert err < tol, (rank, case, what, err)


def test_no_rank_allocates_rows_x_V(results):
    for rank, case, r in _loss_cases(results):
        # The one-process op forms (rows x V) logits and a (V x e) gradient: the recorder
        # sees them, so the bound below is a real check.
        assert r["largest_dim_full"] == 96, (rank, case)
        assert r["largest_dim_tp"] <= r["Vl"], (rank, case, r["largest_dim_tp"], r["Vl"])


def test_vocab_parallel_embedding_and_gathered_logits(results):
    for rank, per_rank in enumerate(results):
        for tp in (4, 2):
            r = per_rank[f"tp{tp} embedding"]
            assert r["lookup"] == 0.0, (rank, tp)
            for what in ("grad E rows", "gathered logits", "gather grad"):
                assert r[what] < 1e-12, (rank, tp, what, r[what])


def test_vocab_not_divisible_by_tp_is_one_line():
    from gpn_scale.models.gpn.parallelize import check_tp
    from gpn_scale.testing.models import tiny_config

    check_tp(tiny_config(n_heads=4, vocab_size=40), 4)
    with pytest.raises(ConfigError) as err:
        check_tp(tiny_config(n_heads=4), 4)  # vocab 37
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("model.vocab_size: 37 does not split over parallel.tp=4")
    assert "model_overrides.vocab_size=40" in msg
