"""The training/validation loader in one process: shapes, epochs, held-out split, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from data_helpers import (
    build_counter_dataset,
    counter_corpus,
    expected_window_keys,
    one_line,
    row_keys,
)

from gpn_scale.data import DataConfig, DataError, build_loader, check_compatible, read_metadata

N_WINDOWS, N_VAL, SEQ = 104, 8, 32  # 96 train windows
BATCH = 8


@pytest.fixture
def dataset(tmp_path) -> str:
    root = str(tmp_path / "ds")
    build_counter_dataset(root, n_windows=N_WINDOWS, val_windows=N_VAL, seq_len=SEQ)
    return root


def _loader(root, tmp_path, name, split="train", **cfg):
    config = DataConfig(remote=root, local_cache=str(tmp_path / f"cache-{name}"), **cfg)
    return build_loader(config, split, BATCH, 0, 1, seq_len=SEQ, vocab_size=257)


def test_batches_epochs_and_metadata(dataset, tmp_path):
    meta = read_metadata(dataset)
    assert (meta.vocab_size, meta.seq_len, meta.eod_token_id) == (257, SEQ, 256)
    assert meta.splits["train"].samples == N_WINDOWS - N_VAL
    assert meta.tokens("val") == N_VAL * SEQ and meta.tokenizer["kind"] == "byte"
    index = json.loads((Path(dataset) / "train" / "index.json").read_text())
    assert meta.splits["train"].shards == len(index["shards"]) > 1
    assert sum(s["samples"] for s in index["shards"]) == N_WINDOWS - N_VAL

    loader = _loader(dataset, tmp_path, "a")
    assert len(loader) == (N_WINDOWS - N_VAL) // BATCH
    batches = list(loader)
    assert all(b.shape == (BATCH, SEQ) and b.dtype == torch.int64 for b in batches)
    assert int(max(b.max() for b in batches)) < 257
    epoch0 = row_keys(batches)
    epoch1 = row_keys(loader)
    assert len(epoch0) == len(set(epoch0)) == N_WINDOWS - N_VAL
    assert sorted(epoch0) == sorted(epoch1), "each epoch covers the split once"
    assert epoch0 != epoch1, "the shuffle should change between epochs"
    assert loader.epoch == 1
    # every iter() starts a new epoch, even when the previous pass was abandoned
    next(iter(loader))
    assert loader.epoch == 2


def test_heldout_split_never_overlaps_train(tmp_path):
    docs = counter_corpus(N_WINDOWS, SEQ)
    root = str(tmp_path / "ds")
    build_counter_dataset(root, n_windows=N_WINDOWS, val_windows=N_VAL, seq_len=SEQ)
    every_window = expected_window_keys(docs, SEQ)
    assert len(set(every_window)) == N_WINDOWS
    cfg = dict(drop_last=False)
    train = row_keys(_loader(root, tmp_path, "t", **cfg))
    val = row_keys(_loader(root, tmp_path, "v", split="val", **cfg))
    assert len(val) == N_VAL and len(train) == N_WINDOWS - N_VAL
    assert not set(train) & set(val), "a held-out window is also in train"
    assert sorted(train + val) == sorted(every_window)
    # val is not shuffled by the loader: the same order every pass
    assert row_keys(_loader(root, tmp_path, "v2", split="val", **cfg)) == val


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mid_epoch_resume_yields_exactly_the_rest(dataset, tmp_path, num_workers):
    reference = row_keys(_loader(dataset, tmp_path, "ref", num_workers=num_workers))
    taken = 5
    loader = _loader(dataset, tmp_path, "run1", num_workers=num_workers)
    iterator = iter(loader)
    consumed = row_keys(next(iterator) for _ in range(taken))
    # workers have prefetched more than `taken` batches; the state must count consumed ones
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["streaming"]["sample_in_epoch"] == taken * BATCH
    del iterator
    restored = _loader(dataset, tmp_path, "run2", num_workers=num_workers)
    restored.load_state_dict(state)
    rest = row_keys(restored)
    assert consumed == reference[: taken * BATCH]
    assert rest == reference[taken * BATCH :]
    # and the restored loader goes on to a full next epoch
    assert sorted(row_keys(restored)) == sorted(reference)


def test_resume_attaches_to_a_resume_segment_another_rank_has_not_sized_yet(dataset, tmp_path):
    """Every rank of a node writes the resume state into one segment named by the node's
    prefix; one that finds it created by another rank but not yet sized ('cannot mmap an
    empty file', a tp = 4 resume in the full suite) attaches again instead of failing."""
    import os
    import threading

    loader = _loader(dataset, tmp_path, "run1")
    iterator = iter(loader)
    head = row_keys(next(iterator) for _ in range(2))
    state = loader.state_dict()
    del iterator
    restored = _loader(dataset, tmp_path, "run2")
    name = f"/dev/shm/{restored.dataset._shm_prefix_int:06}_resume"
    # the other rank: created, sized 0.3 s later (as after a preemption on a busy node)
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    sizer = threading.Timer(0.3, os.ftruncate, (fd, 4096))
    sizer.start()
    try:
        restored.load_state_dict(state)
    finally:
        sizer.join()
        os.close(fd)
    try:
        assert head + row_keys(restored) == row_keys(_loader(dataset, tmp_path, "ref"))
    finally:
        restored.close()
        Path(name).unlink(missing_ok=True)  # the test made it: the loader only attached


def test_resume_inside_second_epoch(dataset, tmp_path):
    reference = _loader(dataset, tmp_path, "ref")
    row_keys(reference)
    epoch1 = row_keys(reference)

    loader = _loader(dataset, tmp_path, "run1")
    row_keys(loader)  # epoch 0 fully
    at_epoch_end = loader.state_dict()
    assert at_epoch_end["streaming"]["epoch"] == 1
    assert at_epoch_end["streaming"]["sample_in_epoch"] == 0
    from_end = _loader(dataset, tmp_path, "from-end")
    from_end.load_state_dict(at_epoch_end)
    assert row_keys(from_end) == epoch1, "a state taken at an epoch's end resumes the next"
    iterator = iter(loader)
    head = row_keys(next(iterator) for _ in range(3))
    state = loader.state_dict()
    assert state["streaming"]["epoch"] == 1
    del iterator
    restored = _loader(dataset, tmp_path, "run2")
    restored.load_state_dict(state)
    assert head + row_keys(restored) == epoch1


def test_state_of_another_dataset_is_refused(dataset, tmp_path):
    other = str(tmp_path / "other")
    build_counter_dataset(other, n_windows=N_WINDOWS, val_windows=N_VAL, seq_len=SEQ, seed=5)
    state = _loader(other, tmp_path, "o").state_dict()
    with pytest.raises(DataError, match="another dataset"):
        _loader(dataset, tmp_path, "d").load_state_dict(state)


def test_model_that_does_not_fit_the_data_gets_one_line(dataset, tmp_path):
    config = DataConfig(remote=dataset, local_cache=str(tmp_path / "c"))
    with pytest.raises(DataError) as err:
        build_loader(config, "train", BATCH, 0, 1, seq_len=SEQ, vocab_size=256)
    assert "vocab mismatch" in one_line(err.value) and "257" in str(err.value)
    with pytest.raises(DataError) as err:
        build_loader(config, "train", BATCH, 0, 1, seq_len=64, vocab_size=257)
    assert "seq_len mismatch" in one_line(err.value)
    with pytest.raises(DataError, match="no split 'test'"):
        build_loader(config, "test", BATCH, 0, 1)
    # a larger (padded) model vocabulary is fine
    check_compatible(read_metadata(dataset), vocab_size=320, seq_len=SEQ)


@pytest.mark.timeout(180)  # streaming alone hangs here with workers (see loader.py)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_corrupted_local_shard_stops_the_epoch_with_its_name(dataset, tmp_path, num_workers):
    shard = sorted((Path(dataset) / "train").glob("*.zstd"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    loader = _loader(dataset, tmp_path, f"bad{num_workers}", num_workers=num_workers)
    with pytest.raises(DataError) as caught:
        row_keys(loader)
    text = one_line(caught.value)
    assert text.startswith("corrupted shard") and f"train/{shard.name}" in text
    assert "Traceback" not in text


def test_close_releases_the_shared_memory_descriptors(dataset, tmp_path):
    """streaming holds a descriptor per shared-memory segment until its dataset is collected:
    a process running several trainings (the test suite did) ran out of them."""
    import os

    def open_shm() -> set[tuple[str, str]]:
        fds = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/"):
                fds.add((fd, target))
        return fds

    loader = _loader(dataset, tmp_path, "closing")
    next(iter(loader))
    own = f"/dev/shm/{loader.dataset._shm_prefix_int:06d}_"  # this dataset's segments
    mine = {(fd, target) for fd, target in open_shm() if target.startswith(own)}
    assert mine
    loader.close()
    assert not (open_shm() & mine)
    assert not any(Path(target).exists() for _, target in mine)  # created ones unlinked


def _streaming_shm_fds() -> int:
    """Descriptors of this process on streaming's segments (/dev/shm/NNNNNN_*)."""
    import os
    import re

    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        count += bool(re.match(r"/dev/shm/\d{6}_", target))
    return count


def test_building_loaders_again_and_again_does_not_accumulate_descriptors(dataset, tmp_path):
    """A process that builds loaders over and over (eval beside a training run, a notebook,
    this suite) holds the descriptors of the loaders it keeps, no more: streaming's prefix walk
    opened (and never closed) every existing prefix's segments on each construction, a restored
    loader opened its resume state again each epoch, and a loader dropped without close() kept
    its segments until the process exited. The suite ran out of its 20,000 descriptors."""
    before = _streaming_shm_fds()
    held = _loader(dataset, tmp_path, "held")  # stays open, like a training run's loader
    next(iter(held))
    holding = _streaming_shm_fds()
    for i in range(3):
        loader = _loader(dataset, tmp_path, f"run{i}")
        iterator = iter(loader)
        next(iterator), next(iterator)
        state = loader.state_dict()
        del iterator
        loader.close()
        restored = _loader(dataset, tmp_path, f"restored{i}")
        restored.load_state_dict(state)
        row_keys(restored), row_keys(restored)  # two epochs, each reads the resume state
        if i % 2:
            restored.close()
        del restored  # the others are dropped unclosed, as in `row_keys(_loader(...))`
        assert _streaming_shm_fds() == holding, f"round {i}"
    held.close()
    assert _streaming_shm_fds() == before


def test_a_tmpdir_too_long_for_the_workers_socket_is_one_line_and_the_longest_allowed_works(
    dataset, tmp_path, private_tmpdir, monkeypatch
):
    """Workers pass batches over a Unix socket under TMPDIR: past the socket path's limit the
    bind fails in a worker thread and the loader would wait forever. The longest TMPDIR the
    check allows must still work with workers; one byte more is refused before any worker."""
    import tempfile

    from gpn_scale.data.loader import _SOCKET_PATH_MAX, _SOCKET_SUFFIX

    longest = _SOCKET_PATH_MAX - _SOCKET_SUFFIX
    fits = private_tmpdir / ("d" * (longest - len(str(private_tmpdir)) - 1))
    assert len(str(fits)) == longest
    fits.mkdir()
    too_long = private_tmpdir / (fits.name + "x")
    too_long.mkdir()

    monkeypatch.setattr(tempfile, "tempdir", str(too_long))
    with pytest.raises(DataError) as err:
        _loader(dataset, tmp_path, "long", num_workers=1)
    assert "TMPDIR" in one_line(err.value) and f"at most {longest} bytes" in str(err.value)

    monkeypatch.setattr(tempfile, "tempdir", str(fits))
    batches = list(_loader(dataset, tmp_path, "fits", num_workers=1))
    assert len(batches) == (N_WINDOWS - N_VAL) // BATCH
