"""A loader killed with SIGKILL leaves /dev/shm segments behind; the next run on the same
cache directory (with its own per-run TMPDIR) must still start."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path

import pytest
from data_helpers import build_counter_dataset, row_keys

from gpn_scale.data import DataConfig, build_loader
from gpn_scale.data.shm import (
    MIN_AGE_S,
    OWNER_RECORD,
    _prefixes_in_use,
    _process_identity,
    clean_stale_streaming_shm,
)

pytestmark = pytest.mark.slow

CHILD = r"""
import sys, time
from gpn_scale.data import DataConfig, build_loader
loader = build_loader(DataConfig(remote=sys.argv[1], local_cache=sys.argv[2]), "train", 4, 0, 1)
iterator = iter(loader)
next(iterator); next(iterator)
print("READY", flush=True)
time.sleep(600)
"""


PLAIN_STREAMING = r"""
import os, sys
from streaming import StreamingDataset
dataset = StreamingDataset(remote=os.path.join(sys.argv[1], "train"),
                           local=os.path.join(sys.argv[2], "train"), batch_size=4)
print("PREFIX", dataset._shm_prefix_int, flush=True)
"""


def _segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if re.match(r"^\d{6}_", p.name)}


def _mapped_by(pid: int) -> set[str]:
    return set(re.findall(r"/dev/shm/(\d{6}_[a-z_]+)", Path(f"/proc/{pid}/maps").read_text()))


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs Linux /dev/shm")
def test_stale_shared_memory_from_a_killed_loader_does_not_stop_the_next_run(tmp_path):
    root, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    build_counter_dataset(root, n_windows=72, val_windows=8)
    child_tmp = tmp_path / "run1-tmp"
    child_tmp.mkdir()
    env = {
        **os.environ,
        "TMPDIR": str(child_tmp),
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
        ),
    }
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, root, cache],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout.readline().strip() == "READY"
        created = _mapped_by(child.pid)
        assert created, "the loader should have registered shared memory"
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # like a preempted / OOM-killed job
        child.wait()
    stale = created & _segments()
    assert stale, "SIGKILL should leave the segments behind (else this test proves nothing)"

    # The trap is real: plain streaming (in a fresh process, with its own TMPDIR like a
    # restarted job) refuses the same cache directory now. It walks prefixes from 0 and
    # reports where it stopped. A prefix below the stale one was free at that
    # moment (other loaders on the machine, the other xdist worker's among them, take and free
    # prefixes all the time): that says nothing either way. So does a prefix past it when the
    # stale registration of our cache directory is gone by then (another job's loader removes
    # a dead owner's segments at once, gpn_scale/data/shm.py). A walk past it while it is
    # still there would mean streaming lets stale segments pass, and this fix is pointless.
    stale_prefix = min(int(name[:6]) for name in stale)
    stale_locals = Path(f"/dev/shm/{stale_prefix:06d}_locals")

    def registers_our_cache() -> bool:
        try:
            return os.path.join(cache, "train").encode() in stale_locals.read_bytes()
        except FileNotFoundError:
            return False

    gc.collect()  # loaders earlier tests dropped free their prefixes now, not mid-check
    plain_tmp = tmp_path / "run2-tmp"
    plain_tmp.mkdir()
    plain = subprocess.run(
        [sys.executable, "-c", PLAIN_STREAMING, root, cache],
        env={**env, "TMPDIR": str(plain_tmp)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if plain.returncode == 0:
        taken = int(plain.stdout.split("PREFIX", 1)[1])
        if taken >= stale_prefix:
            assert not registers_our_cache(), (
                f"streaming took prefix {taken}, past the stale {stale_prefix} of this cache"
            )
    else:
        assert "Reused local directory" in plain.stderr, plain

    # Our loader removes the unmapped segments that register its cache dir, and runs.
    loader = build_loader(DataConfig(remote=root, local_cache=cache), "train", 4, 0, 1)
    # The killed job's segments are gone: any segment still under one of their names is a live
    # process's, which took the freed prefix number again: the new loader here, or another
    # job's (the other xdist worker's loaders take the lowest free prefix too).
    in_use = _prefixes_in_use() or set()
    left = stale & _segments()
    assert all(name in _mapped_by(os.getpid()) or name[:6] in in_use for name in left), left
    keys = row_keys(loader)
    assert len(keys) == len(set(keys)) == 64


def _fake_segment(name: str, payload: bytes, age_s: float) -> Path:
    from gpn_scale.data import shm

    path = shm.SHM_DIR / name
    path.write_bytes(payload)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def _locals_payload(dirs: list[str], prefix: int) -> bytes:
    text = ("\0".join(dirs) + f"\0{prefix}").encode()
    return (4 + len(text)).to_bytes(4, "little") + text


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs Linux /dev/shm")
def test_cleaner_keeps_live_and_young_segments_of_others(tmp_path):
    base = 900000 + int(uuid.uuid4().int % 90000)  # far above any prefix streaming uses
    ours = str(tmp_path / "cache" / "train")
    old_other = _fake_segment(f"{base:06}_locals", _locals_payload(["/x/other"], base), 3600)
    young_other = _fake_segment(f"{base + 1:06}_locals", _locals_payload(["/x/y"], base + 1), 0)
    young_ours = _fake_segment(f"{base + 2:06}_locals", _locals_payload([ours], base + 2), 0)
    young_ours_part = _fake_segment(f"{base + 2:06}_barrier", b"\0" * 12, 0)
    live = shared_memory.SharedMemory(f"{base + 3:06}_barrier", create=True, size=16)
    live_path = Path("/dev/shm") / live.name
    os.utime(live_path, (time.time() - 3600,) * 2)
    try:
        removed = clean_stale_streaming_shm(our_locals=[ours], min_age_s=MIN_AGE_S)
        assert not old_other.exists() and not young_ours.exists()
        assert not young_ours_part.exists()
        assert young_other.exists(), "a young segment of another job was removed"
        assert live_path.exists(), "a segment mapped by a live process was removed"
        assert young_ours.name in removed
    finally:
        young_other.unlink(missing_ok=True)
        live.close()
        live.unlink()


def _owner_record(prefix: int, pid: int, start: str, locals_seg: Path) -> Path:
    import json

    from gpn_scale.data import shm

    st = locals_seg.stat()
    path = shm.SHM_DIR / f"{OWNER_RECORD}{prefix:06}"
    path.write_text(
        json.dumps(
            {
                "pid": pid,
                "start": start,
                "pidns": os.readlink("/proc/self/ns/pid"),
                "locals": [st.st_ino, st.st_ctime_ns],
            }
        )
    )
    return path


@pytest.fixture
def private_shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The cleaner's /dev/shm as a directory of its own on the same tmpfs: a dead owner's
    fake segments and record in the real /dev/shm are cleaned by any loader that starts
    meanwhile (the other xdist worker's), which removed them, record and all, before this
    test's cleaner could judge its own lock file by them (seen in a full run)."""
    from gpn_scale.data import shm

    path = Path("/dev/shm") / f"gpn-test-{uuid.uuid4().hex}"
    path.mkdir()
    monkeypatch.setattr(shm, "SHM_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs Linux /dev/shm")
def test_cleaner_judges_recorded_prefixes_by_their_owner_pid(tmp_path, private_shm):
    """A prefix whose owner record names a dead process goes at once (young, another job's
    cache dir, its filelocks too); one whose owner lives stays (old, mapped by nobody)."""
    base = 900000 + int(uuid.uuid4().int % 90000)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_start = _process_identity(dead.pid)[0]
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead_locals = _fake_segment(f"{base:06}_locals", _locals_payload(["/x/a"], base), 0)
    dead_part = _fake_segment(f"{base:06}_barrier", b"\0" * 12, 0)
    live_locals = _fake_segment(f"{base + 1:06}_locals", _locals_payload(["/x/b"], base + 1), 3600)
    lock = tmp_path / f"{base:06}_barrier_filelock"
    lock.write_text("")
    records = [
        _owner_record(base, dead.pid, dead_start, dead_locals),
        _owner_record(base + 1, live.pid, _process_identity(live.pid)[0], live_locals),
    ]
    try:
        clean_stale_streaming_shm(str(tmp_path))
        assert not dead_locals.exists() and not dead_part.exists() and not lock.exists()
        assert not records[0].exists()
        assert live_locals.exists() and records[1].exists()
    finally:
        live.kill()
        live.wait()
        for path in (live_locals, *records):
            path.unlink(missing_ok=True)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs Linux /dev/shm")
def test_a_prefix_this_process_freed_and_a_dead_job_took_since_is_stale(tmp_path, private_shm):
    """This process registered a prefix number once and let it go; another job registered the
    same number since and was killed. The number is not this process's any more: the cleaner
    removes it (the full suite's loaders met this: a loader saw a killed job's cache as live)."""
    from gpn_scale.data import shm

    base = 900000 + int(uuid.uuid4().int % 90000)
    ours_then = _fake_segment(f"{base:06}_locals", _locals_payload(["/x/then"], base), 0)
    shm.record_owner(base)
    assert shm._owner_alive(f"{base:06}") is True
    ours_then.unlink()  # released (streaming unlinks at a normal close)
    (private_shm / f"{OWNER_RECORD}{base:06}").unlink(missing_ok=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_start = _process_identity(dead.pid)[0]
    dead.wait()
    theirs = _fake_segment(f"{base:06}_locals", _locals_payload(["/x/theirs"], base), 0)
    record = _owner_record(base, dead.pid, dead_start, theirs)
    try:
        assert shm._owner_alive(f"{base:06}") is False
        clean_stale_streaming_shm(str(tmp_path))
        assert not theirs.exists() and not record.exists()
    finally:
        shm._OWN_PREFIXES.pop(f"{base:06}", None)
        for path in (theirs, record):
            path.unlink(missing_ok=True)


RACER = r"""
import os, sys, time
import streaming.base.shared.prefix as prefix

_find = prefix._check_and_find


def slow_find(*args, **kwargs):
    # Widen streaming's window between finding a free prefix and creating its segment, so
    # that jobs starting together certainly meet in it (by default they do only sometimes).
    found = _find(*args, **kwargs)
    time.sleep(0.3)
    return found


prefix._check_and_find = slow_find
from gpn_scale.data import DataConfig, build_loader

# A barrier, not a start time: on a loaded machine the imports of three children can take
# any time. Each says it is ready, then all leave together when the parent says go.
ready, go = sys.argv[3], sys.argv[4]
open(ready, "w").close()
deadline = time.time() + 170
while not os.path.exists(go):
    if time.time() > deadline:
        sys.exit("no go from the parent")
    time.sleep(0.001)
loader = build_loader(DataConfig(remote=sys.argv[1], local_cache=sys.argv[2]), "train", 4, 0, 1)
next(iter(loader))
print("OK", flush=True)
"""


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs Linux /dev/shm")
def test_jobs_starting_together_on_one_machine_register_distinct_prefixes(tmp_path):
    """Like SLURM array tasks packed on one node: three jobs (own caches, own TMPDIRs) build
    their loaders at the same moment. streaming's prefix registration is check-then-create;
    without gpn_scale's registration lock two of them pick one prefix and one fails with
    FileExistsError."""
    root = str(tmp_path / "ds")
    build_counter_dataset(root, n_windows=72, val_windows=8)
    go = tmp_path / "go"
    ready = [tmp_path / f"ready{i}" for i in range(3)]
    children = []
    for i in range(3):
        job_tmp = tmp_path / f"job{i}-tmp"
        job_tmp.mkdir()
        env = {**os.environ, "TMPDIR": str(job_tmp)}
        children.append(
            subprocess.Popen(
                [sys.executable, "-c", RACER, root, str(tmp_path / f"cache{i}"), str(ready[i])]
                + [str(go)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    deadline = time.time() + 170
    while not all(path.exists() for path in ready):
        exited = [child for child in children if child.poll() is not None]
        assert not exited, exited[0].communicate()[1][-2000:]
        assert time.time() < deadline, "the children did not finish their imports in 170 s"
        time.sleep(0.05)
    go.touch()
    results = [child.communicate(timeout=180) for child in children]
    for child, (out, err) in zip(children, results):
        assert child.returncode == 0, err[-2000:]
        assert out.strip() == "OK"


TWO_NODE_RANK = r"""
import sys, time
from pathlib import Path
import torch.distributed as dist
from gpn_scale.data.shm import registration_lock

job, rank, root, delay = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{root}/{job}.init", rank=rank, world_size=2)
time.sleep(delay)
# Rank r is its job's local leader on "node" r: each node has its own lock file.
with registration_lock(True, lock_dir=root / f"node{rank}"):
    dist.barrier()  # what streaming's prefix registration does while the locks are held
    time.sleep(0.2)
    dist.barrier()
print("DONE", flush=True)
dist.destroy_process_group()
"""


def test_two_multi_node_jobs_on_the_same_nodes_do_not_deadlock_on_the_locks(tmp_path):
    """Two 2-node jobs start together on the same two nodes; job a reaches node 0's lock
    first and job b node 1's. Holding a node's lock while waiting at a job-wide barrier for
    the other node's lock (blocking, one node at a time) deadlocks: a waits for b's node, b
    for a's. The job takes all its nodes' locks or none, so both finish."""
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
    delays = {("a", 0): 0.0, ("a", 1): 1.5, ("b", 0): 1.5, ("b", 1): 0.0}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-c", TWO_NODE_RANK, key[0], str(key[1]), str(tmp_path), str(d)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for key, d in delays.items()
    }
    try:
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=90)
            assert proc.returncode == 0 and out.strip() == "DONE", (key, err[-2000:])
    finally:
        for proc in procs.values():
            proc.kill()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs Linux /dev/shm")
def test_the_cleaner_judges_and_removes_under_the_registration_lock(private_shm, monkeypatch):
    """A job registering a prefix while another job's loader cleans could take a number that a
    dead job's record still names, and lose its fresh segments to the cleaner's judgement
    made before they existed (a full suite's run: the job's second rank found no
    `/000000_locals`). So the cleaner holds the lock registrations take, from its judgement to
    its last removal; with the lock held elsewhere it would wait."""
    import fcntl

    from gpn_scale.data import shm

    held: list[bool] = []
    judge = shm._prefixes_in_use

    def probing():
        fd = os.open(private_shm / shm.REGISTRATION_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)
        return judge()

    monkeypatch.setattr(shm, "_prefixes_in_use", probing)
    clean_stale_streaming_shm()
    assert held == [True]
    # and it is let go after
    fd = os.open(private_shm / shm.REGISTRATION_LOCK, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


AGREEING_RANK = r"""
import sys, types
from pathlib import Path
import torch.distributed as dist
from gpn_scale.data import streaming_compat, streaming_prefix

rank, root = int(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=3)
prefix = streaming_compat.import_streaming().base.shared.prefix
# Each rank's scan of /dev/shm found another first free prefix (another job freed some
# between them); ranks 0-1 are node 0 (leader 0), rank 2 is node 1 (its own leader).
found = {0: 5, 1: 3, 2: 7}[rank]
prefix._check_and_find_retrying = lambda *args, **kwargs: found
world = types.SimpleNamespace(node=rank // 2, is_local_leader=rank in (0, 2))


def registration(streams_local, streams_remote, world, retry):
    # what streaming's get_shm_prefix registers or opens: the number its scan gives
    return prefix._check_and_find_retrying(streams_local, streams_remote, "x", retry)


got = streaming_prefix.agreed_shm_prefix(registration, ["/l"], [None], world, 1)
print("PREFIX", got, prefix._check_and_find_retrying() == found, flush=True)
dist.destroy_process_group()
"""


def test_the_ranks_of_a_node_register_their_local_leaders_prefix(tmp_path):
    """streaming has every rank scan /dev/shm for the first free prefix on its own; when
    another job frees one between two ranks' scans they found different numbers, and the
    non-leader then found no `_locals` segment (the suite's FSDP2 test: 'shared memory
    prefix=0 was not registered by local leader'). Each rank now takes its node's leader's
    number, and the scan is streaming's own again afterwards."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", AGREEING_RANK, str(rank), str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    got = [out.split("PREFIX", 1)[1].split() for out, _ in outs]
    assert got == [["5", "True"], ["5", "True"], ["7", "True"]]


TRACKER_SPY = r"""
import sys, uuid
from multiprocessing import resource_tracker, shared_memory
sent = []
resource_tracker._resource_tracker._send = lambda cmd, name, rtype: sent.append((cmd, name))
from gpn_scale.data import DataConfig, build_loader
loader = build_loader(DataConfig(remote=sys.argv[1], local_cache=sys.argv[2]), "train", 4, 0, 1)
state = loader.state_dict()
first = sum(1 for _ in loader)
loader.load_state_dict(state)  # the resume segment, then an epoch that reads it
second = sum(1 for _ in loader)
loader.close()
other = shared_memory.SharedMemory(f"gpn-test-{uuid.uuid4().hex[:8]}", create=True, size=8)
other.close(); other.unlink()
print("BATCHES", first, second)
print("SENT", sent)
"""


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs Linux /dev/shm")
def test_streaming_segments_never_reach_the_resource_tracker(tmp_path):
    """Python's resource tracker unlinks a dead process's segments by name, a moment after a
    SIGKILL: by then the prefix may be another live loader's, which then shares its resume
    state with the next (shm.py). A loader's segments are not registered with it; other
    shared memory still is, and is unregistered when unlinked."""
    root = str(tmp_path / "ds")
    build_counter_dataset(root, n_windows=32, val_windows=8)
    proc = subprocess.run(
        [sys.executable, "-c", TRACKER_SPY, root, str(tmp_path / "cache")],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = proc.stdout.split("BATCHES", 1)[1].split()[:2]
    assert first == second != "0", proc.stdout
    sent = eval(proc.stdout.split("SENT", 1)[1])  # noqa: S307 - our own child's repr
    assert [cmd for cmd, name in sent if "gpn-test-" in name] == ["REGISTER", "UNREGISTER"]
    assert [(cmd, name) for cmd, name in sent if re.search(r"/\d{6}_", name)] == []


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs Linux /dev/shm")
def test_a_loader_killed_alone_leaves_its_segments_to_the_cleaner(tmp_path):
    """SIGKILL the loader's process alone (its DataLoader workers and any resource tracker
    live on a moment, as after `kill -9` of a trainer): nothing unlinks its segments behind
    the cleaner's back. Before, its tracker did ('There appear to be N leaked
    shared_memory objects'), by name, after the cleaner could have handed the prefix to a
    new loader."""
    root, cache = str(tmp_path / "ds"), str(tmp_path / "cache")
    build_counter_dataset(root, n_windows=72, val_windows=8)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD.replace("local_cache=", "num_workers=2, local_cache="),
            root,
            cache,
        ],
        env={
            **os.environ,
            "TMPDIR": str(tmp_path),
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
            ),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout.readline().strip() == "READY"
        os.kill(child.pid, signal.SIGKILL)
        # stderr ends when every process holding it has exited: the workers and a tracker
        _, err = child.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
    assert "leaked shared_memory" not in err, err[-3000:]
    clean_stale_streaming_shm(our_locals=[os.path.join(cache, "train")])  # its owner is dead
