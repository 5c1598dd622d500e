"""The run lease (gpn_scale.checkpoint.lease) on a local root and on S3 (moto): one owner at
a time, a one-line refusal naming the owner, an explicit take-over, stale leases replaced,
and a taken-over owner that stops renewing instead of writing over the new one."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from gpn_scale.checkpoint.lease import LEASE, LeaseHeld, RunLease, is_live, read_lease
from gpn_scale.io.storage import open_storage


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return open_storage(str(tmp_path / "ckpt"))
    s3 = request.getfixturevalue("s3_endpoint")
    return open_storage(f"{s3.create_bucket(f'lease-{uuid.uuid4().hex[:8]}')}/run")


def test_one_owner_refusal_take_over_and_release(storage):
    a = RunLease(storage, ttl_s=60, owner="slurm-job-1")
    assert a.acquire() is None
    lease = read_lease(storage)
    assert lease["owner"] == "slurm-job-1" and is_live(lease)
    b = RunLease(storage, ttl_s=60, owner="slurm-job-2")
    b_host = dict(lease, host="another-node")  # a live lease of a job on another node
    storage.put_bytes(LEASE, json.dumps(b_host).encode())
    with pytest.raises(LeaseHeld) as err:
        b.acquire()
    msg = str(err.value)
    assert "\n" not in msg and "slurm-job-1 on host another-node" in msg and "--take-over" in msg
    assert "took the run over from slurm-job-1" in b.acquire(take_over=True)
    a.release()  # the old owner leaves the new owner's lease alone
    assert read_lease(storage)["owner"] == "slurm-job-2"
    again = RunLease(storage, ttl_s=60, owner="slurm-job-2")  # a requeue: same job id
    assert again.acquire() is None
    b.release()
    again.release()
    assert read_lease(storage) is None


def test_stale_lease_is_replaced(storage):
    storage.put_bytes(
        LEASE,
        json.dumps(
            {"owner": "slurm-job-9", "host": "gone", "pid": 1, "heartbeat": 0, "ttl_s": 60}
        ).encode(),
    )
    lease = RunLease(storage, ttl_s=60, owner="slurm-job-10")
    assert "replaced the stale lease of slurm-job-9" in lease.acquire()
    lease.release()


def _second_storage(storage):
    """Another process's view of the same root (its own storage object)."""
    return open_storage(storage.uri)


def _after_first_read(storage, action):
    """Run `action` once, right after the first read of the lease through `storage`: another
    job acting between this one's read and its write, deterministically."""
    done = []
    for name in ("get_bytes", "get_versioned"):
        real = getattr(storage, name, None)
        if real is None:
            continue

        def wrapped(*args, _real=real, **kwargs):
            out = _real(*args, **kwargs)
            if not done:
                done.append(True)
                action()
            return out

        setattr(storage, name, wrapped)


def test_two_jobs_starting_together_on_a_new_run_cannot_both_take_it(storage):
    """Issue 36 case 2: both starters read "no lease", then both wrote theirs and trained. The
    write is conditional now: the second writer's lands nowhere, it reads the winner's live
    lease and refuses in one line."""
    winner = RunLease(_second_storage(storage), ttl_s=60, owner="host-a-pid-1")
    loser = RunLease(storage, ttl_s=60, owner="host-b-pid-2")
    _after_first_read(storage, winner.acquire)  # the winner writes between our read and write
    with pytest.raises(LeaseHeld, match="host-a-pid-1") as err:
        loser.acquire()
    assert "\n" not in str(err.value)
    assert winner.held and not loser.held
    assert read_lease(storage)["owner"] == "host-a-pid-1"
    winner.release()
    assert read_lease(storage) is None


def test_two_jobs_replacing_one_stale_lease_cannot_both_take_it(storage):
    storage.put_bytes(
        LEASE,
        json.dumps(
            {"owner": "slurm-job-9", "host": "gone", "pid": 1, "heartbeat": 0, "ttl_s": 60}
        ).encode(),
    )
    winner = RunLease(_second_storage(storage), ttl_s=60, owner="slurm-job-10")
    loser = RunLease(storage, ttl_s=60, owner="slurm-job-11")
    notes = []
    _after_first_read(storage, lambda: notes.append(winner.acquire()))
    with pytest.raises(LeaseHeld, match="slurm-job-10"):
        loser.acquire()
    assert "replaced the stale lease of slurm-job-9" in notes[0]
    assert read_lease(storage)["owner"] == "slurm-job-10"
    winner.release()


def test_a_holder_whose_lease_was_taken_over_knows_it_and_never_writes_over_it(storage):
    """Issue 36 case 13: the taken-over trainer trained and saved on. Its heartbeat now finds
    the new owner's lease (check, and the thread's `lost`), and a renewal racing the take-over
    (read ours, the taker writes, then our write) lands nowhere."""
    old = RunLease(storage, ttl_s=0.5, owner="slurm-job-1")  # looks every 0.1 s
    old.acquire()
    assert old.check(renew=True) is None and old.lost is None
    taker = RunLease(_second_storage(storage), ttl_s=60, owner="slurm-job-2")
    _after_first_read(storage, lambda: taker.acquire(take_over=True))
    line = old.check(renew=True)  # reads its own lease, the taker writes, the renewal loses
    assert line and "\n" not in line and "taken over by slurm-job-2" in line, line
    assert old.lost == line and read_lease(storage)["owner"] == "slurm-job-2"
    old.release()  # leaves the new owner's lease alone
    assert read_lease(storage)["owner"] == "slurm-job-2"

    # The heartbeat thread sees a take-over by itself, and writes nothing after it.
    again = RunLease(_second_storage(storage), ttl_s=0.5, owner="slurm-job-3")
    again.acquire(take_over=True)
    assert taker.lost is None
    taker.check()  # (the taker's own thread looks only every 5 s at ttl 60)
    assert "taken over by slurm-job-3" in (taker.lost or "")
    third = RunLease(_second_storage(storage), ttl_s=60, owner="slurm-job-4")
    third.acquire(take_over=True)
    for _ in range(100):  # its thread looks every 0.1 s
        if again.lost:
            break
        time.sleep(0.05)
    assert "taken over by slurm-job-4" in (again.lost or "")
    time.sleep(0.3)
    assert read_lease(storage)["owner"] == "slurm-job-4"
    for lease in (taker, again, third):
        lease.release()
    assert read_lease(storage) is None
