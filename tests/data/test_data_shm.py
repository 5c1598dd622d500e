"""A loader killed with SIGKILL leaves /dev/shm segments behind; the next run on the same
cache directory (with its own per-run TMPDIR) must still start."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_helpers import build_counter_dataset, row_keys
from gpn_scale.data import DataConfig, build_loader
from gpn_scale.data.shm import MIN_AGE_S

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
StreamingDataset(remote=os.path.join(sys.argv[1], "train"),
                 local=os.path.join(sys.argv[2], "train"), batch_size=4)
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
    env = {**os.environ, "TMPDIR": str(child_tmp),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                       os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen([sys.executable, "-c", CHILD, root, cache], env=env,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "READY"
        created = _mapped_by(child.pid)
        assert created, "the loader should have registered shared memory"
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # like a preempted / OOM-killed job
        child.wait()
    stale = created & _segments()
    assert stale, "SIGKILL should leave the segments behind (else this test proves nothing)"
    time.sleep(MIN_AGE_S + 0.2)

    # The trap is real: plain streaming (in a fresh process, with its own TMPDIR like a
    # restarted job) refuses the same cache directory now.
    plain_tmp = tmp_path / "run2-tmp"
    plain_tmp.mkdir()
    plain = subprocess.run([sys.executable, "-c", PLAIN_STREAMING, root, cache],
                           env={**env, "TMPDIR": str(plain_tmp)}, capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode != 0 and "Reused local directory" in plain.stderr

    # Our loader cleans what no live process maps, and runs a full epoch.
    loader = build_loader(DataConfig(remote=root, local_cache=cache), "train", 4, 0, 1)
    keys = row_keys(loader)
    assert len(keys) == len(set(keys)) == 64
