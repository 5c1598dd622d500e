"""`--resume auto` never destroys (issue 36, item 1), at the manager: damaged checkpoints are
never started over in silence, a manifest is held to its folder's step, the newest complete
checkpoint beats a stale `latest` pointer, and a load that finds damage falls back to the
checkpoint before it. The damage is made on disk here; no clocks are read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from ckpt_helpers import (
    Evil,
    app_state,
    apply,
    assert_same_training_state,
    fresh,
    rewrite_manifest_entry,
    trained,
)

from gpn_scale.checkpoint import (
    CheckpointDamaged,
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    step_dir_name,
)
from gpn_scale.checkpoint.catalog import find_latest


def _save(mgr: CheckpointManager, step: int, seed: int = 0) -> str:
    model, opt = trained(seed=seed)
    return mgr.save(
        step,
        app_state(model, opt),
        meta={"step": step, "tokens": 10 * step},
        rank_state={"rng": capture_rng_state()},
    )


def _set_written(uri: str, created_unix: float) -> None:
    """The manifest's save time, set by hand: which save came last, without a clock."""
    path = Path(uri) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["created_unix"] = created_unix
    path.write_text(json.dumps(manifest))


def _point_latest_at(root: Path, step: int) -> None:
    (root / "latest").write_text(json.dumps({"step": step, "name": step_dir_name(step)}))


def _flip_a_byte_keeping_mtime(path: Path) -> None:
    """Same size, same mtime, other content: only a full sha256 finds it (at load)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# -- case 1: every checkpoint damaged -------------------------------------------------------


def test_all_checkpoints_damaged_refuses_in_one_line_naming_them_and_fresh(tmp_path: Path):
    root = tmp_path / "ck"
    mgr = CheckpointManager(str(root), keep_last=5)
    uris = [_save(mgr, s, seed=s) for s in (2, 4)]
    for uri in uris:  # the per-rank state gone, the weights (.distcp) intact
        (Path(uri) / "rank_00000.pt").unlink()
    assert mgr.resolve_resume("auto") is None
    with pytest.raises(CheckpointError) as caught:
        mgr.refuse_start_over()
    line = str(caught.value)
    assert "\n" not in line and "--fresh" in line, line
    assert "step_000000004: file rank_00000.pt is missing" in line, line
    assert "step_000000002: file rank_00000.pt is missing" in line, line
    # Nothing was touched: the step folders and their weights are all still there.
    assert all((Path(uri) / "__0_0.distcp").is_file() for uri in uris)


def test_saves_that_never_finished_do_not_stop_a_start(tmp_path: Path):
    """A folder without a manifest is a save that did not finish: nothing in it to resume."""
    root = tmp_path / "ck"
    (root / step_dir_name(2)).mkdir(parents=True)
    (root / step_dir_name(2) / "__0_0.distcp").write_bytes(b"half")
    mgr = CheckpointManager(str(root))
    assert mgr.resolve_resume("auto") is None
    mgr.refuse_start_over()  # no error
    assert mgr.skipped == [
        (str(root / step_dir_name(2)), "no manifest.json (the save did not finish)")
    ]


# -- case 7: a manifest in a folder of another step ------------------------------------------


def test_manifest_step_must_match_its_folder(tmp_path: Path):
    root = tmp_path / "ck"
    mgr = CheckpointManager(str(root), keep_last=5)
    good = _save(mgr, 20)
    moved = Path(_save(mgr, 27, seed=1))
    renamed = root / step_dir_name(25)
    moved.rename(renamed)  # step 27's checkpoint now sits in step_000000025
    assert mgr.latest() == good
    assert mgr.skipped == [
        (
            str(renamed),
            "manifest.json says step 27, but its folder is step_000000025 (a renamed or "
            "copied folder?)",
        )
    ]
    with pytest.raises(CheckpointError, match="cannot resume from .*step_000000025: manifest"):
        mgr.resolve_resume(str(renamed))
    with pytest.raises(CheckpointDamaged, match="says step 27"):
        mgr.load(str(renamed), app_state(*fresh()))


def test_meta_step_must_match_its_folder_and_the_save(tmp_path: Path):
    root = tmp_path / "ck"
    mgr = CheckpointManager(str(root), keep_last=5)
    uri = _save(mgr, 3)
    path = Path(uri) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["meta"]["step"] = 5
    path.write_text(json.dumps(manifest))
    assert mgr.latest() is None
    assert mgr.skipped[0][1].startswith("manifest.json's meta says step 5, but its folder")
    model, opt = trained()
    with pytest.raises(CheckpointError, match="meta says step 6, the save is of step 4"):
        mgr.save(4, app_state(model, opt), meta={"step": 6})
    assert not (root / step_dir_name(4)).exists()


# -- case 14: a stale `latest` pointer ------------------------------------------------------


def test_newest_complete_checkpoint_beats_a_stale_pointer(tmp_path: Path):
    root = tmp_path / "ck"
    mgr = CheckpointManager(str(root), keep_last=5)
    old, new = _save(mgr, 10), _save(mgr, 20, seed=1)
    _set_written(old, 1000.0)
    _set_written(new, 2000.0)
    _point_latest_at(root, 10)  # the pointer's update after step 20 was lost
    assert mgr.latest() == new
    assert mgr.note == (
        f"the `latest` pointer names {old}, but {new} is complete and was written after it; "
        "taking step_000000020 (the pointer is stale)"
    )
    assert mgr.resolve_resume("auto") == new
    assert find_latest(mgr.storage)[0] == new  # --latest-step (train.sbatch) agrees


def test_pointer_still_wins_over_a_higher_step_written_before_it(tmp_path: Path):
    """A run resumed from an older checkpoint re-saves a lower step after the higher one:
    that is not stale, the pointer names the run's newest."""
    root = tmp_path / "ck"
    mgr = CheckpointManager(str(root), keep_last=5)
    higher, lower = _save(mgr, 50), _save(mgr, 30, seed=1)
    _set_written(higher, 2000.0)
    _set_written(lower, 3000.0)
    assert mgr.latest() == lower and mgr.note == ""


# -- case 16: damage found only at load ------------------------------------------------------


@pytest.mark.parametrize("damage", ["sha256_same_mtime", "pickled_code_in_rank_file"])
def test_damage_found_at_load_falls_back_to_the_checkpoint_before(tmp_path: Path, damage: str):
    root = tmp_path / "ck"
    mgr = CheckpointManager(str(root), keep_last=5)
    _save(mgr, 1, seed=1)
    bad = Path(_save(mgr, 2, seed=2))
    if damage == "sha256_same_mtime":
        _flip_a_byte_keeping_mtime(bad / "__0_0.distcp")
        why = "file __0_0.distcp does not match its sha256 in the manifest"
    else:
        torch.save({"rng": Evil(str(tmp_path / "pwned"))}, bad / "rank_00000.pt")
        rewrite_manifest_entry(bad, "rank_00000.pt")
        why = "refusing to load"
    assert mgr.resolve_resume("auto") == str(bad)  # the cheap checks pass: found at load
    model, opt = fresh()
    app = app_state(model, opt)
    logs: list[str] = []
    loaded = mgr.load_newest(str(bad), lambda uri: mgr.load(uri, app), logs.append)
    apply(model, opt, app)
    assert loaded.step == 1 and loaded.uri == str(root / step_dir_name(1))
    assert_same_training_state(*trained(seed=1), model, opt)
    assert len(logs) == 1 and logs[0].startswith(f"resume auto: cannot load {bad}: "), logs
    assert why in logs[0] and logs[0].endswith(f"falling back to {loaded.uri}"), logs
    assert not (tmp_path / "pwned").exists()


def test_damage_at_load_with_nothing_to_fall_back_to_names_them_and_fresh(tmp_path: Path):
    root = tmp_path / "ck"
    mgr = CheckpointManager(str(root), keep_last=5)
    uris = [Path(_save(mgr, s, seed=s)) for s in (1, 2)]
    for uri in uris:
        _flip_a_byte_keeping_mtime(uri / "__0_0.distcp")
    app = app_state(*fresh())
    logs: list[str] = []
    with pytest.raises(CheckpointError) as caught:
        mgr.load_newest(str(uris[1]), lambda uri: mgr.load(uri, app), logs.append)
    line = str(caught.value)
    assert "\n" not in line and "--fresh" in line, line
    for name in ("step_000000002", "step_000000001"):
        assert f"{name}: file __0_0.distcp does not match its sha256" in line, line
    assert len(logs) == 1  # step 2 -> step 1, then nothing left
    assert all((uri / "manifest.json").is_file() for uri in uris)  # nothing deleted


def test_an_error_that_is_not_damage_does_not_fall_back(tmp_path: Path):
    """Another model's shapes would fail on every older checkpoint too: said at once."""
    mgr = CheckpointManager(str(tmp_path / "ck"), keep_last=5)
    _save(mgr, 1)
    uri = _save(mgr, 2)
    logs: list[str] = []
    wrong = {"model": {"0.weight": torch.zeros(2, 2)}}
    with pytest.raises(CheckpointError, match="0.weight is") as caught:
        mgr.load_newest(uri, lambda u: mgr.load(u, wrong), logs.append)
    assert not isinstance(caught.value, CheckpointDamaged) and logs == []
