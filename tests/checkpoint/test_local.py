"""Single-process checkpoints on a local directory: round trip, latest, partials, retention,
refusal of pickled code, bad paths."""

from __future__ import annotations

import enum
import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_helpers import (
    Evil,
    app_state,
    apply,
    assert_same,
    assert_same_training_state,
    fresh,
    rewrite_manifest_entry,
    trained,
)

from gpn_scale.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng_state,
    restore_rng_state,
    step_dir_name,
)
from gpn_scale.core.config import ConfigError

META = {
    "step": 7,
    "tokens": 1234,
    "loader": {"epoch": 0, "sample_in_epoch": 40},
    "wandb_run_id": "abc123",
    "config": {"lr": 0.01},
}


def _save(mgr: CheckpointManager, step: int, seed: int = 0) -> str:
    model, opt = trained(seed=seed)
    return mgr.save(
        step,
        app_state(model, opt),
        meta={**META, "step": step},
        rank_state={"rng": capture_rng_state()},
    )


def test_round_trip_exact(tmp_path: Path) -> None:
    model, opt = trained(seed=0)
    mgr = CheckpointManager(str(tmp_path / "ck"))
    mgr.preflight()
    rng = capture_rng_state()
    expect = (
        torch.rand(3),
        random.random(),
        np.random.rand(),
    )  # what comes after the captured state
    uri = mgr.save(
        7, app_state(model, opt), meta=META, rank_state={"rng": rng, "extra": [1, 2.5, "x"]}
    )
    assert uri == str(tmp_path / "ck" / "step_000000007")
    assert mgr.latest() == uri and mgr.resolve_resume("auto") == uri

    model2, opt2 = fresh()
    app = app_state(model2, opt2)
    loaded = mgr.load(uri, app)
    apply(model2, opt2, app)
    assert_same_training_state(model, opt, model2, opt2)
    assert loaded.meta == META and loaded.step == 7 and loaded.uri == uri and loaded.world_size == 1
    assert loaded.rank_state is not None
    assert_same(loaded.rank_state, {"rng": rng, "extra": [1, 2.5, "x"]})

    # The restored RNG continues exactly where the saved one was (fresh() reseeded torch meanwhile).
    restore_rng_state(loaded.rank_state["rng"])
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expect[0], got[0]) and expect[1:] == got[1:]

    manifest = json.loads((Path(uri) / "manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["world_size"] == 1 and manifest["meta"] == META
    assert mgr.read_meta(uri) == META
    assert {".metadata", "__0_0.distcp", "rank_00000.pt"} == set(manifest["files"])
    assert not any((tmp_path / "ck" / ".staging").rglob("*.distcp"))  # staging is cleaned up


def test_checkpoint_error_is_a_config_error() -> None:
    assert issubclass(CheckpointError, ConfigError)
    assert "\n" not in str(CheckpointError("a\nb"))


def test_resolve_resume(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "ck"))
    assert mgr.resolve_resume("auto") is None and mgr.latest() is None
    assert mgr.resolve_resume("none") is None
    uri = _save(mgr, 5)
    assert mgr.resolve_resume(uri) == uri
    assert mgr.resolve_resume(uri + "/") == uri
    (Path(uri) / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json.*--resume auto"):
        mgr.resolve_resume(uri)
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        mgr.resolve_resume(str(tmp_path / "elsewhere"))


def test_resume_from_other_root(tmp_path: Path) -> None:
    src = CheckpointManager(str(tmp_path / "a"))
    uri = _save(src, 3)
    dst = CheckpointManager(str(tmp_path / "b"))
    assert dst.resolve_resume(uri) == uri
    model2, opt2 = fresh()
    assert dst.load(uri, app_state(model2, opt2)).step == 3


def test_latest_is_newest_and_retention_keeps_k(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "ck"), keep_last=2)
    uris = [_save(mgr, s, seed=s) for s in (10, 20, 30, 40)]
    assert mgr.latest() == uris[-1]
    steps = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step_"))
    assert steps == [step_dir_name(30), step_dir_name(40)]
    assert [c[0] for c in mgr.list_checkpoints()] == [40, 30]


def test_retention_deletes_old_partials_but_not_newer_dirs(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "ck"), keep_last=1)
    _save(mgr, 10)
    stale = tmp_path / "ck" / step_dir_name(15)  # an abandoned partial from a crashed save
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half")
    newer = tmp_path / "ck" / step_dir_name(99)  # something newer (not ours to judge): left alone
    newer.mkdir()
    (newer / "__0_0.distcp").write_bytes(b"x")
    uri = _save(mgr, 20)
    names = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step_"))
    assert names == [step_dir_name(20), step_dir_name(99)]
    assert mgr.latest() == uri  # the partial newer dir is never picked


@pytest.mark.parametrize(
    "damage",
    ["no_manifest", "missing_rank_file", "missing_metadata", "size", "hash", "bad_manifest"],
)
def test_partial_or_damaged_never_picked(tmp_path: Path, damage: str) -> None:
    mgr = CheckpointManager(str(tmp_path / "ck"), keep_last=5)
    good = _save(mgr, 1)
    bad = _save(mgr, 2, seed=1)
    assert mgr.latest() == bad
    d = Path(bad)
    if damage == "no_manifest":
        (d / "manifest.json").unlink()
    elif damage == "missing_rank_file":
        (d / "rank_00000.pt").unlink()
    elif damage == "missing_metadata":
        (d / ".metadata").unlink()
    elif damage == "size":
        with open(d / "__0_0.distcp", "ab") as f:
            f.write(b"extra")
    elif damage == "hash":
        data = bytearray((d / "__0_0.distcp").read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, different content
        (d / "__0_0.distcp").write_bytes(bytes(data))
    elif damage == "bad_manifest":
        (d / "manifest.json").write_text("{not json")
    assert mgr.latest() == good
    assert mgr.resolve_resume("auto") == good
    with pytest.raises(CheckpointError, match="pick a complete checkpoint"):
        mgr.load(bad, app_state(*fresh()))


def test_hash_mismatch_detected_on_load_even_with_preserved_mtime(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "ck"))
    uri = _save(mgr, 1)
    f = Path(uri) / "__0_0.distcp"
    st = f.stat()
    data = bytearray(f.read_bytes())
    data[100] ^= 0x01
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # defeat the cheap mtime check
    with pytest.raises(CheckpointError, match=r"__0_0.distcp does not match its sha256"):
        mgr.load(uri, app_state(*fresh()))


def test_pointer_missing_or_garbage_falls_back_to_scan(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "ck"))
    _save(mgr, 1)
    uri2 = _save(mgr, 2)
    (tmp_path / "ck" / "latest").write_text("garbage")
    assert mgr.latest() == uri2
    (tmp_path / "ck" / "latest").unlink()
    assert mgr.latest() == uri2


def test_pointer_wins_over_higher_step(tmp_path: Path) -> None:
    # A run resumed from an older checkpoint re-saves a lower step: the pointer says what is latest.
    mgr = CheckpointManager(str(tmp_path / "ck"), keep_last=5)
    _save(mgr, 50)
    uri = _save(mgr, 30)
    assert mgr.latest() == uri


def test_resave_same_step_replaces_it(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "ck"))
    _save(mgr, 4, seed=0)
    model, opt = trained(seed=5)
    uri = mgr.save(4, app_state(model, opt), meta={"v": 2})
    model2, opt2 = fresh()
    app = app_state(model2, opt2)
    loaded = mgr.load(uri, app)
    apply(model2, opt2, app)
    assert_same_training_state(model, opt, model2, opt2)
    assert loaded.meta == {"v": 2} and loaded.rank_state is None


def test_meta_must_be_json(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "ck"))
    model, opt = trained()
    with pytest.raises(CheckpointError, match="meta is not JSON-serialisable"):
        mgr.save(1, app_state(model, opt), meta={"t": torch.zeros(1)})
    assert mgr.latest() is None


# -- loading never unpickles code ---------------------------------------------------------------


def test_pickled_object_in_rank_file_refused(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "ck"))
    uri = _save(mgr, 1)
    marker = tmp_path / "pwned"
    torch.save({"rng": Evil(str(marker))}, Path(uri) / "rank_00000.pt")
    rewrite_manifest_entry(Path(uri), "rank_00000.pt")
    assert mgr.latest() == uri  # consistent with its manifest: only the loader can tell
    with pytest.raises(
        CheckpointError, match=r"refusing to load .*rank_00000.pt.*weights_only"
    ) as ei:
        mgr.load(uri, app_state(*fresh()))
    assert "\n" not in str(ei.value)
    assert not marker.exists()


def test_pickled_object_in_dcp_metadata_refused(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "ck"))
    uri = _save(mgr, 1)
    marker = tmp_path / "pwned"
    (Path(uri) / ".metadata").write_bytes(pickle.dumps(Evil(str(marker))))
    rewrite_manifest_entry(Path(uri), ".metadata")
    with pytest.raises(
        CheckpointError, match=r"refusing to load .*\.metadata.*not plain DCP metadata"
    ):
        mgr.load(uri, app_state(*fresh()))
    assert not marker.exists()


class _Getattr:
    """Pickles as getattr(obj, name), as Python 3.11.2 writes enum members in DCP metadata."""

    def __init__(self, obj: object, name: str) -> None:
        self.obj, self.name = obj, name

    def __reduce__(self):
        return (getattr, (self.obj, self.name))


def test_dcp_metadata_enum_member_by_getattr_loads_and_other_getattr_refused() -> None:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from gpn_scale.checkpoint.safe_load import safe_unpickle_metadata

    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    data = pickle.dumps([_Getattr(_MEM_FORMAT_ENCODING, member.name)])
    assert b"getattr" in data
    assert safe_unpickle_metadata(data, "m") == [member]
    for obj, name in (
        (torch.Size, "__reduce__"),
        (_MEM_FORMAT_ENCODING, "__class__"),
        (_MEM_FORMAT_ENCODING, "_member_map_"),
    ):
        with pytest.raises(
            CheckpointError, match="not plain DCP metadata.*only for an enum member"
        ):
            safe_unpickle_metadata(pickle.dumps(_Getattr(obj, name)), "m")


class Stage(enum.Enum):  # module level: torch's weights_only loader allowlists it by path
    ONE = 1


def test_weights_only_files_read_enum_member_by_getattr_and_refuse_other_getattr(
    tmp_path: Path,
) -> None:
    from gpn_scale.checkpoint.safe_load import safe_torch_load

    path = tmp_path / "state.pt"
    torch.save({"stage": _Getattr(Stage, "ONE")}, path)
    assert safe_torch_load(path, extra_safe_globals=[Stage]) == {"stage": Stage.ONE}
    torch.save({"x": _Getattr(Stage, "__class__")}, path)
    with pytest.raises(CheckpointError, match="refusing to load .*state.pt"):
        safe_torch_load(path, extra_safe_globals=[Stage])


def test_pickled_object_in_dcp_value_refused(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "ck"))
    model, opt = trained()
    marker = tmp_path / "pwned"
    uri = mgr.save(1, {**app_state(model, opt), "extra": Evil(str(marker))}, meta={})
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"refusing to unpickle checkpoint value 'extra'"):
        mgr.load(uri, {**app_state(*fresh()), "extra": None})
    assert not marker.exists()


# -- bad input ----------------------------------------------------------------------------------


def test_unwritable_root_fails_in_preflight(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    mgr = CheckpointManager(str(blocker / "ck"))
    with pytest.raises(
        CheckpointError, match=r"cannot write to checkpoint directory .*file/ck.*checkpoint root"
    ) as ei:
        mgr.preflight()
    assert "\n" not in str(ei.value)


def test_read_only_root_fails_in_preflight(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        root = Path("/proc/gpn_ckpt_test")  # root ignores permission bits; /proc refuses everyone
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        root = ro / "ck"
    with pytest.raises(CheckpointError, match=r"cannot write to checkpoint directory"):
        CheckpointManager(str(root), staging_dir=str(tmp_path / "stage")).preflight()


def test_unwritable_staging_fails_in_preflight(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    mgr = CheckpointManager(str(tmp_path / "ck"), staging_dir=str(blocker / "stage"))
    with pytest.raises(
        CheckpointError, match=r"staging directory .* is not writable.*pass a writable staging_dir"
    ):  # the argument this caller passed (the trainer's own roots: tests/train, issue 36)
        mgr.preflight()


def test_bad_arguments() -> None:
    with pytest.raises(CheckpointError, match="keep_last"):
        CheckpointManager("/tmp/x", keep_last=0)
    with pytest.raises(CheckpointError, match="unsupported scheme 'gs'"):
        CheckpointManager("gs://bucket/x")
    with pytest.raises(CheckpointError, match="no bucket"):
        CheckpointManager("s3:///prefix")


def test_deepspeed_files_load_weights_only(tmp_path: Path) -> None:
    """DeepSpeed's files go through the same weights_only loader (plus DeepSpeed's data classes)."""
    from gpn_scale.checkpoint.safe_load import deepspeed_safe_load

    ok = tmp_path / "ok.pt"
    torch.save({"optimizer_state_dict": {"step": torch.tensor(3.0)}, "ds_version": "0.19.8"}, ok)
    assert deepspeed_safe_load(str(ok))["ds_version"] == "0.19.8"
    bad = tmp_path / "bad.pt"
    marker = tmp_path / "pwned"
    torch.save({"optimizer_state_dict": Evil(str(marker))}, bad)
    with pytest.raises(CheckpointError, match=r"refusing to load .*bad.pt.*weights_only=True"):
        deepspeed_safe_load(str(bad))
    assert not marker.exists()


def test_staging_on_another_filesystem_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node-local staging + shared-filesystem root: rename fails with EXDEV, the file is copied."""
    import errno

    real_replace = os.replace
    crossed = {"n": 0}

    def replace(src, dst):  # type: ignore[no-untyped-def]
        if ".staging-elsewhere" in str(src):
            crossed["n"] += 1
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    mgr = CheckpointManager(str(tmp_path / "ck"), staging_dir=str(tmp_path / ".staging-elsewhere"))
    model, opt = trained()
    uri = mgr.save(3, app_state(model, opt), meta={}, rank_state={"a": 1})
    assert crossed["n"] == 3  # .metadata, the shard, the rank file
    assert mgr.latest() == uri
    model2, opt2 = fresh()
    app = app_state(model2, opt2)
    mgr.load(uri, app)
    apply(model2, opt2, app)
    assert_same_training_state(model, opt, model2, opt2)


def test_retention_with_a_resumed_older_run(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path / "ck"), keep_last=1)
    _save(mgr, 50)
    uri30 = _save(mgr, 30)  # resumed from an older checkpoint: 50 is newer, left alone
    assert mgr.latest() == uri30
    assert (tmp_path / "ck" / step_dir_name(50) / "manifest.json").exists()
    uri40 = _save(mgr, 40)
    assert mgr.latest() == uri40
    assert not (tmp_path / "ck" / step_dir_name(30)).exists()  # older than the new latest: retired


def test_a_tensor_saved_in_another_shape_is_one_line_naming_it(tmp_path: Path) -> None:
    """A parameter whose layout changed (GPN's W_1: (2f, d) -> (2, f, d)) fails before DCP's
    collective trace, naming the key and both shapes."""
    mgr = CheckpointManager(str(tmp_path / "ckpt"))
    uri = mgr.save(1, {"model": {"ffn.w1.weight": torch.ones(4, 3), "b": torch.zeros(2)}}, meta={})
    live = {"model": {"ffn.w1.weight": torch.zeros(2, 2, 3), "b": torch.zeros(2)}}
    with pytest.raises(CheckpointError) as err:
        mgr.load(uri, live)
    msg = str(err.value)
    assert (
        "\n" not in msg and "model.ffn.w1.weight is (4, 3) in the checkpoint but (2, 2, 3)" in msg
    )
    assert float(live["model"]["ffn.w1.weight"].abs().sum()) == 0.0  # nothing loaded
