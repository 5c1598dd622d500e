"""The run lease (gpn_scale.checkpoint.lease) on a local root and on S3 (moto): one owner at
a time, a one-line refusal naming the owner, an explicit take-over, stale leases replaced,
and a taken-over owner that stops renewing instead of writing over the new one."""

from __future__ import annotations

import json
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
