"""Real multi-process checkpoints on gloo: FSDP2 saves on 2 ranks and loads on 1 (resharding);
DeepSpeed ZeRO-2 saves and loads through the manager. Each rank is a separate python process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import app_state, apply, assert_same, fresh, make_mlp

from gpn_scale.checkpoint import CheckpointManager
from gpn_scale.testing.s3 import free_port

WORKER = Path(__file__).resolve().parent / "dist_worker.py"
REPO = Path(__file__).resolve().parents[2]


def run_ranks(
    args: list[str], world: int = 2, timeout: float = 300, extra_env: dict | None = None
) -> None:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **(extra_env or {}),
    }
    procs = []
    for rank in range(world):
        penv = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                env=penv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{text[-6000:]}"


@pytest.mark.slow
def test_fsdp2_two_ranks_save_one_rank_loads(s3_bucket: str, tmp_path: Path) -> None:
    local_root = str(tmp_path / "ck")
    s3_root = f"{s3_bucket}/fsdp"
    run_ranks(["fsdp_save", str(tmp_path), local_root, s3_root])
    ref = torch.load(tmp_path / "reference.pt", weights_only=True)

    for root in (local_root, s3_root):
        mgr = CheckpointManager(
            root, staging_dir=str(tmp_path / "stage1")
        )  # no process group: world 1
        uri = mgr.latest()
        assert uri is not None and uri.endswith("step_000000005")
        model, opt = fresh()
        app = app_state(model, opt)
        loaded = mgr.load(uri, app)
        apply(model, opt, app)
        assert (
            loaded.world_size == 2 and loaded.rank_state is None
        )  # other world size: no rank state
        assert loaded.meta == {"step": 5, "tokens": 640}
        got = app_state(model, opt)  # full (unsharded) state of the plain module
        assert_same(got["model"], ref["model"], "model")
        assert_same(got["optim"], ref["optim"], "optim")
        # The 2-rank checkpoint really was sharded: one DCP file per rank.
        import json

        raw = mgr.storage.get_bytes(uri.rsplit("/", 1)[-1] + "/manifest.json")
        files = json.loads(raw)["files"]
        assert {
            "__0_0.distcp",
            "__1_0.distcp",
            ".metadata",
            "rank_00000.pt",
            "rank_00001.pt",
        } <= set(files)
        assert {files["__0_0.distcp"]["rank"], files["__1_0.distcp"]["rank"]} == {0, 1}
    # The reference is not trivially equal to a fresh model.
    assert not torch.equal(ref["model"]["0.weight"], make_mlp(0)[0].weight)


@pytest.mark.slow
def test_deepspeed_zero2_save_load(s3_bucket: str, tmp_path: Path) -> None:
    local_root = str(tmp_path / "ds")
    s3_root = f"{s3_bucket}/ds"
    run_ranks(
        ["deepspeed", str(tmp_path), local_root, s3_root],
        timeout=600,
        extra_env={"DS_ACCELERATOR": "cpu"},  # the build cache: tests/conftest.py
    )
    assert len(list(tmp_path.glob("deepspeed_ok_*"))) == 2
    mgr = CheckpointManager(local_root)
    manifest_files = set(
        __import__("json").loads(
            (Path(local_root) / "step_000000003" / "manifest.json").read_text()
        )["files"]
    )
    assert "mp_rank_00_model_states.pt" in manifest_files
    assert {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    } <= manifest_files
    # A DeepSpeed checkpoint is not loadable as DCP (and says so).
    from gpn_scale.checkpoint import CheckpointError

    with pytest.raises(
        CheckpointError, match="deepspeed checkpoint; load it with the matching load method"
    ):
        mgr.load(mgr.latest(), app_state(*fresh()))
