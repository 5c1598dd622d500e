"""gpn_scale/data/streaming_compat.py: every private name of mosaicml-streaming the patches
rely on is declared, matches the installed streaming, and an upgrade that moves one fails in
one line naming it, the installed version and the pin."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from data_helpers import build_counter_dataset, one_line

from gpn_scale.data import DataConfig, DataError, build_loader, shm, streaming_import
from gpn_scale.data import streaming_compat as compat

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def streaming():
    return compat.import_streaming()


def _where(entry: compat.Private) -> str:
    return entry.where


@pytest.mark.parametrize("entry", compat.PRIVATE, ids=_where)
def test_each_declared_private_name_matches_the_installed_streaming(streaming, entry):
    assert compat.problem(entry) == ""


def test_check_passes_quietly_on_the_pinned_streaming(streaming):
    assert compat.installed_version(streaming) in compat.SUPPORTED_VERSIONS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check(streaming)


def test_the_pin_is_the_one_of_pyproject_and_constraints():
    pin = re.escape(compat.STREAMING_PIN)
    for name in ("pyproject.toml", "constraints.txt"):
        text = (REPO / name).read_text()
        assert re.search(rf"^\s*\"?{pin}\"?,?\s*$", text, re.M), f"{name} does not pin {pin}"
    assert compat.STREAMING_PIN.endswith("==" + compat.SUPPORTED_VERSIONS[0])


def _raises_one_line(streaming) -> str:
    with pytest.raises(compat.StreamingCompatError) as info:
        compat.check(streaming)
    assert isinstance(info.value, DataError)
    return one_line(info.value)


def test_a_method_that_moved_is_named_in_one_line(streaming, monkeypatch):
    from streaming.base.dataset import StreamingDataset

    monkeypatch.delattr(StreamingDataset, "_resume")
    text = _raises_one_line(streaming)
    assert text.startswith(
        f"mosaicml-streaming {streaming.__version__}: "
        "streaming.base.dataset.StreamingDataset._resume moved (not found; used by "
    )
    assert "this project supports streaming 0.13.0 (mosaicml-streaming==0.13.0)" in text
    assert "pin it with constraints.txt" in text


def test_a_changed_signature_is_named_with_both_parameter_lists(streaming, monkeypatch):
    from streaming.base.shared.memory import SharedMemory

    monkeypatch.setattr(SharedMemory, "cleanup", lambda self, force=False: None)
    text = _raises_one_line(streaming)
    assert (
        "streaming.base.shared.memory.SharedMemory.cleanup changed (expected params (self), "
        "found (self, force))"
    ) in text


def test_code_that_no_longer_sets_an_attribute_the_patch_reads_is_named(streaming, monkeypatch):
    from streaming.base.storage.download import CloudDownloader, S3Downloader

    def __init__(self):  # an upgrade that renamed _requester_pays_buckets
        CloudDownloader.__init__(self)
        self._payer_buckets = []

    monkeypatch.setattr(S3Downloader, "__init__", __init__)
    text = _raises_one_line(streaming)
    assert (
        "streaming.base.storage.download.S3Downloader.__init__ changed "
        "(no longer uses _requester_pays_buckets)"
    ) in text


def test_a_segment_name_shm_relies_on_is_checked_by_value(streaming, monkeypatch):
    monkeypatch.setattr("streaming.base.constant.LOCALS", "locals_v2")
    text = _raises_one_line(streaming)
    assert "streaming.base.constant.LOCALS changed (expected 'locals', found 'locals_v2')" in text


def test_two_problems_are_both_named_on_the_one_line(streaming, monkeypatch):
    from streaming.base.dataset import StreamingDataset, _Iterator

    monkeypatch.delattr(StreamingDataset, "_ready_thread")
    monkeypatch.delattr(_Iterator, "on_exit")
    text = _raises_one_line(streaming)
    assert "StreamingDataset._ready_thread moved" in text and "_Iterator.on_exit moved" in text


def test_the_version_is_named_when_something_moved_and_warned_when_nothing_did(
    streaming, monkeypatch
):
    from streaming.base.dataset import StreamingDataset

    monkeypatch.setattr(streaming, "__version__", "0.14.0")
    with pytest.warns(UserWarning, match=r"^mosaicml-streaming 0\.14\.0 is not the tested 0\.13"):
        compat.check(streaming)
    monkeypatch.delattr(StreamingDataset, "prepare_shard")
    text = _raises_one_line(streaming)
    assert text.startswith("mosaicml-streaming 0.14.0: streaming.base.dataset.StreamingDataset")


def test_the_loader_checks_once_before_it_touches_streaming(streaming, monkeypatch, tmp_path):
    from streaming.base.dataset import StreamingDataset

    root = str(tmp_path / "ds")
    build_counter_dataset(root, n_windows=24, val_windows=8, seq_len=32)
    monkeypatch.setattr(compat, "_CHECKED", False)
    monkeypatch.delattr(StreamingDataset, "_resume")
    config = DataConfig(remote=root, local_cache=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"StreamingDataset\._resume moved") as info:
        build_loader(config, "train", 4, 0, 1)
    one_line(info.value)
    monkeypatch.undo()
    monkeypatch.setattr(compat, "_CHECKED", False)
    loader = build_loader(config, "train", 4, 0, 1)
    try:
        assert compat._CHECKED and next(iter(loader)).shape == (4, 32)
    finally:
        loader.close()


def _streaming_bases(cls: type) -> list[type]:
    return [b for b in cls.__mro__ if b.__module__.split(".")[0] == "streaming"]


def test_every_streaming_member_the_patches_override_is_declared(streaming):
    from gpn_scale.data.loader import _token_dataset_class

    declared = {entry.where for entry in compat.PRIVATE}
    overridden: dict[str, list[str]] = {}
    for cls in (_token_dataset_class(), compat.s3_downloader_class()):
        patches = [c for c in cls.__mro__ if c.__module__.startswith("gpn_scale.")]
        base = _streaming_bases(cls)[0]
        for patch in patches:
            for name, value in vars(patch).items():
                if callable(value) and hasattr(base, name):
                    overridden.setdefault(base.__name__, []).append(name)
                    where = f"{base.__module__}.{base.__qualname__}.{name}"
                    assert where in declared, f"{where} is overridden but not in PRIVATE"
    assert sorted(overridden["StreamingDataset"]) == [
        "__iter__", "_prepare_thread", "_ready_thread", "_resume", "load_state_dict",
        "on_exception", "prepare_shard",
    ]  # fmt: skip
    assert overridden["S3Downloader"] == ["_download_file_impl"]


def test_the_error_texts_the_loader_matches_are_still_streaming_s(streaming):
    for module, text in compat.MESSAGES:
        source = inspect.getsource(importlib.import_module(module))
        assert text in source, f"{module} no longer says {text!r} (loader.translate_stream_error)"


def test_shm_reads_the_names_and_locals_layout_streaming_writes(streaming, monkeypatch, tmp_path):
    from streaming.base.constant import LOCALS
    from streaming.base.shared.prefix import _get_path, _pack_locals

    name = _get_path(42, LOCALS)
    assert shm._SEGMENT.match(name) and name == "000042_locals"
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    (tmp_path / name).write_bytes(_pack_locals(["/cache/a/train", "/cache/b"], 42))
    assert shm._registered_locals("000042") == ["/cache/a/train", "/cache/b"]


def test_streaming_import_stands_in_for_exactly_what_streaming_imports(streaming):
    dataloader = ast.parse(inspect.getsource(importlib.import_module("streaming.base.dataloader")))
    imported = {
        node.module: alias.name
        for node in ast.walk(dataloader)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers")
        for alias in node.names
    }
    assert imported == streaming_import._TRANSFORMERS_NAMES
    init = ast.parse(Path(streaming.__file__).read_text())
    packages = {
        alias.name
        for node in ast.walk(init)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name.startswith("streaming.") and not alias.name.startswith("streaming.base")
    }
    assert packages == set(streaming_import._DEFERRED_PACKAGES)
    declared = {e.where for e in compat.PRIVATE if "streaming_import" in e.used_by}
    assert {f"streaming.base.dataloader.{n}" for n in imported.values()} <= declared
    assert set(streaming_import._DEFERRED_PACKAGES) <= declared


def test_the_check_costs_well_under_a_millisecond(streaming):
    import time

    start = time.perf_counter()
    for _ in range(10):
        compat.check(streaming)
    assert (time.perf_counter() - start) / 10 < 0.005  # measured: 0.2 ms


def test_the_checked_import_still_leaves_transformers_and_the_datasets_unloaded():
    code = (
        "import sys\n"
        "from gpn_scale.data import streaming_compat as c\n"
        "c.import_streaming(); c.patched_dataset_class(); c.install_s3_downloader()\n"
        "assert c._CHECKED\n"
        "assert 'transformers' not in sys.modules and 'torchvision' not in sys.modules\n"
        "assert type(sys.modules['streaming.text']).__name__ == '_DeferredPackage'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
