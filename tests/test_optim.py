"""The optimizer (gpn_scale/optim.py): the LR schedule and which parameters decay."""

from __future__ import annotations

import math

import pytest
import torch

from gpn_scale.models.gpn import GPN, load_model_config
from gpn_scale.optim import build_adamw, decays, lr_at


def test_lr_schedule_warmup_cosine_floor():
    lrs = [lr_at(s, 1.0, 10, 110, 0.1) for s in range(110)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))  # linear warmup
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # monotone cosine decay
    assert lrs[-1] == pytest.approx(0.1)  # floor at the last step
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 50 / 99)))


def test_weight_decay_only_on_matrices():
    model = GPN(load_model_config("tiny"))
    opt = build_adamw(model, 1e-3, (0.9, 0.95), 1e-8, 0.1)
    by_id = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    assert len(by_id) == len(names)
    for name, p in names.items():
        wd = by_id[id(p)]
        if p.ndim < 2 or name.endswith(("A_log", "dt_bias")):
            assert wd == 0.0, name
        else:
            assert wd == 0.1, name
    assert any(n.endswith("A_log") for n in names) and any(n.endswith("dt_bias") for n in names)
    assert not decays("write.A_log", torch.zeros(2, 2))
