"""A disk that fills up during a checkpoint write (issue 36, item 4, case 9): the DCP shard or
the rank state written into the staging directory finds no room. It was "unexpected pos 10048
vs 9936" (torch's own file writer) or a squashed DCP traceback; now one line says "no space
left on device", the staging directory and the fix. The full disk is /dev/full, linked where
the file is about to be written: real writes that fail with ENOSPC, nothing else faked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ckpt_helpers import app_state, trained

from gpn_scale.checkpoint import CheckpointError, CheckpointManager
from gpn_scale.checkpoint.rng import capture_rng_state

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")


def _full_disk_at(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Link `name` in the staging directory of the next save to /dev/full."""
    real = CheckpointManager._begin

    def begin(self, step, meta):  # type: ignore[no-untyped-def]
        out, stage = real(self, step, meta)
        os.symlink("/dev/full", stage / name)
        return out, stage

    monkeypatch.setattr(CheckpointManager, "_begin", begin)


@pytest.mark.parametrize("name", ["__0_0.distcp", "rank_00000.pt"])
def test_a_full_disk_is_named_with_the_staging_dir_and_a_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    root = tmp_path / "ck"
    mgr = CheckpointManager(str(root))
    model, opt = trained(seed=0)
    _full_disk_at(monkeypatch, name)
    with pytest.raises(CheckpointError) as caught:
        mgr.save(
            3, app_state(model, opt), meta={"step": 3}, rank_state={"rng": capture_rng_state()}
        )
    msg = str(caught.value)
    assert "checkpoint step_000000003 not saved" in msg
    assert "no space left on device" in msg and str(root / ".staging") in msg
    assert "free space there" in msg and "checkpoint.root" in msg
    assert "unexpected pos" not in msg and "\n" not in msg
    assert mgr.latest() is None


def test_an_s3_root_names_gpn_ckpt_staging(
    s3_endpoint, s3_bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staging = tmp_path / "stage"
    monkeypatch.setenv("GPN_CKPT_STAGING", str(staging))
    mgr = CheckpointManager(f"{s3_bucket}/ck", s3_backoff_s=0.0)
    model, opt = trained(seed=0)
    _full_disk_at(monkeypatch, "rank_00000.pt")
    with pytest.raises(CheckpointError) as caught:
        mgr.save(
            3, app_state(model, opt), meta={"step": 3}, rank_state={"rng": capture_rng_state()}
        )
    msg = str(caught.value)
    assert "no space left on device" in msg and str(staging) in msg
    assert "set GPN_CKPT_STAGING to a local disk with room" in msg and "\n" not in msg
