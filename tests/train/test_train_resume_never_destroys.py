"""`--resume auto` never destroys (issue 36, item 1), at the trainer: over a checkpoint root
whose checkpoints are all damaged a start stops in one line (exit 2) naming them and --fresh,
touching nothing; a checkpoint found damaged at load falls back to the one before it.
(The manager's side of each case: tests/checkpoint/test_resume_auto.py.)"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from train_helpers import train_args

from gpn_scale.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_from_main" / "step_000000002"


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_all_checkpoints_damaged_stops_in_one_line_and_touches_nothing(corpus, tmp_path, capsys):
    """A trainer's own step-2 checkpoint whose rank_00000.pt is gone (its .distcp weights
    intact), and the run's history: `--resume auto` used to start at step 0 over them."""
    run_dir = tmp_path / "run"
    step_dir = run_dir / "checkpoints" / "step_000000002"
    shutil.copytree(FIXTURE, step_dir)
    (step_dir / "rank_00000.pt").unlink()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train/loss": 6.2}\n')
    before = _files(run_dir)
    args = train_args(corpus, run_dir, "schedule.total_steps=3", "--resume", "auto")
    for extra in ([], ["--dry-run"]):  # a dry run says what the start would
        capsys.readouterr()
        assert main(args + extra) == 2
        printed = capsys.readouterr()
        err = printed.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("gpn-scale: error: resume auto: "), err
        assert f"{step_dir.name}: file rank_00000.pt is missing" in err[0], err
        assert "--fresh" in err[0], err
        assert "starting fresh" not in printed.out
        assert _files(run_dir) == before
        assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "metrics.jsonl"]


class _Loader:
    def __init__(self) -> None:
        self.state: Any = None

    def load_state_dict(self, state: Any) -> None:
        self.state = state


class _TrainModule:
    """The plain train module's load (parallel/train_module.py), for a small Linear + AdamW."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 3)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.model(torch.randn(2, 4)).sum().backward()
        self.opt.step()  # the optimizer's state exists

    def app_state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd}

    def load(self, mgr: Any, uri: str) -> Any:
        app = self.app_state()
        loaded = mgr.load(uri, app)
        set_state_dict(
            self.model, self.opt, model_state_dict=app["model"], optim_state_dict=app["optim"]
        )
        return loaded


def test_restore_auto_falls_back_past_a_checkpoint_damaged_at_load(tmp_path):
    from gpn_scale.checkpoint import CheckpointManager, capture_rng_state
    from gpn_scale.train.checkpointing import RunCheckpoints

    mgr = CheckpointManager(str(tmp_path / "ck"), keep_last=5)
    saved = {}
    for step in (2, 4):
        train_module = _TrainModule(seed=step)
        saved[step] = {k: v.clone() for k, v in train_module.model.state_dict().items()}
        rank_state = {"rng": capture_rng_state(), "loader": {"at": step}}
        meta = {"step": step, "tokens": 8 * step, "loader": {"at": step}}
        mgr.save(step, train_module.app_state(), meta=meta, rank_state=rank_state)
    shard = tmp_path / "ck" / "step_000000004" / "__0_0.distcp"
    mtime = shard.stat().st_mtime_ns
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(mtime, mtime))  # only the full sha256 at load finds it

    logs: list[str] = []
    cfg = SimpleNamespace(
        to_dict=dict, checkpoint=SimpleNamespace(initial_load=None, async_mode="off")
    )
    ckpt = RunCheckpoints(
        cfg, SimpleNamespace(), mgr, logs.append, strategy="none",  # type: ignore[arg-type]
        run_dir=str(tmp_path), resume="auto", eval_only=False, fresh=False, take_over=False,
    )  # fmt: skip
    uri, _ = ckpt.start_points(model_cfg=None)
    assert uri == str(tmp_path / "ck" / "step_000000004")
    train_module, loader = _TrainModule(seed=99), _Loader()
    state = ckpt.restore(uri, train_module, loader, model_cfg=None)  # type: ignore[arg-type]
    assert state.step == 2 and state.tokens == 16 and loader.state == {"at": 2}
    for key, value in train_module.model.state_dict().items():
        assert torch.equal(value, saved[2][key]), key
    fallback = [line for line in logs if "falling back" in line]
    assert fallback == [
        f"resume auto: cannot load {uri}: file __0_0.distcp does not match its sha256 in the "
        f"manifest; falling back to {tmp_path / 'ck' / 'step_000000002'}"
    ], logs
    assert any(line.startswith("resumed from ") and "at step 2" in line for line in logs), logs
