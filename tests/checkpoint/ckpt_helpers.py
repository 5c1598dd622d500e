"""Shared helpers for the checkpoint tests: a tiny MLP + AdamW and exact state comparisons."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def trained(
    seed: int = 0, steps: int = 3, lr: float = 1e-2
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP + AdamW with non-trivial optimizer state (exp_avg, exp_avg_sq, step)."""
    model = make_mlp(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def fresh(seed: int = 99, lr: float = 0.5) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A differently initialised model + optimizer (different lr) with its state materialised."""
    return trained(seed=seed, steps=1, lr=lr)


def app_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def apply(model: nn.Module, opt: torch.optim.Optimizer, app: dict[str, Any]) -> None:
    set_state_dict(model, opt, model_state_dict=app["model"], optim_state_dict=app["optim"])


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact (bitwise for tensors) equality of nested state."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (
            path,
            sorted(map(str, a)),
            sorted(map(str, b)),
        )
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def assert_same_training_state(
    m1: nn.Module, o1: torch.optim.Optimizer, m2: nn.Module, o2: torch.optim.Optimizer
) -> None:
    assert_same(m1.state_dict(), m2.state_dict(), "model")
    assert_same(o1.state_dict(), o2.state_dict(), "optim")


def rewrite_manifest_entry(step_dir: Path, rel: str) -> None:
    """Make the manifest agree with a tampered file (a malicious but self-consistent checkpoint)."""
    mpath = step_dir / "manifest.json"
    manifest = json.loads(mpath.read_text())
    data = (step_dir / rel).read_bytes()
    entry = manifest["files"].setdefault(rel, {"rank": 0})
    entry.update(
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        mtime_ns=(step_dir / rel).stat().st_mtime_ns,
    )
    mpath.write_text(json.dumps(manifest))


class Evil:
    """Unpickling this runs code (it would create `marker`); loading must refuse it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (exec, (f"import pathlib; pathlib.Path({self.marker!r}).touch()",))
