"""Shared fixtures for the whole test suite.

S3 without a cloud account
--------------------------
`s3_endpoint` (session scope) starts moto's S3 server on a free 127.0.0.1 port, over
real HTTP, and for the rest of the session sets in os.environ:

    S3_ENDPOINT_URL=http://127.0.0.1:<port>   (boto3 via our code, and streaming, read it)
    AWS_ACCESS_KEY_ID=testing  AWS_SECRET_ACCESS_KEY=testing  AWS_DEFAULT_REGION=us-east-1

Child processes started after the fixture (torch.multiprocessing spawn, torchrun,
subprocess) inherit that environment, so they reach the same server. The value is a
`gpn_scale.testing.s3.LocalS3`: `.url`, `.env()`, `.client()`, `.create_bucket(name)`.

`s3_bucket` (function scope) creates a fresh, uniquely named bucket for one test and
returns its URL, "s3://<name>"; use it so tests never see each other's objects:

    def test_roundtrip(s3_bucket):
        root = f"{s3_bucket}/dataset"      # s3://test-ab12cd34/dataset

Note streaming's filelocks live in tempfile.gettempdir(): tests that build loaders should
give themselves a private TMPDIR (tests/data/conftest.py does this for the data tests).
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpn_scale.ops.triton_interpreter import prepare_interpreter
from gpn_scale.testing.s3 import LocalS3

# The CUDA step backend's Triton kernels run on CPU tensors in Triton's interpreter
# (tests/ops): it must be chosen before triton decorates them, i.e. before any import of
# gpn_scale.ops.gpn_step.triton_kernels. Without a GPU nothing else reads it; with one the
# kernels run compiled on it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Without its per-launch walk of triton.language, its bf16 casts rounded as the GPU's
    # (ops/triton_interpreter.py; launches through ops.launch prepare it too).
    prepare_interpreter()

# One build cache for compiled extensions (the engine's step kernels, DeepSpeed's ops) shared
# by this process and every child the tests start (the trainer tests pass the same path).
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "torch_extensions"
    ),
)


# pytest-xdist (addopts `-n auto`) runs the suite on one worker per core. The tests that
# start a local SLURM cluster run on one worker, one after another: every cluster numbers its
# jobs from 1 and train.sbatch derives a job's rendezvous port from its id, so two clusters'
# jobs would meet on one port. They are one work unit, the largest, so it is handed out
# first; every other test is a unit of its own. (xdist's own `--dist loadgroup` does not
# group under pytest 9.2, which no longer lets it rename the tests it groups.)
SLURM_DIRS = ("tests/slurm/", "tests/sweeps/")
SLURM_FIXTURES = {"slurm_cluster", "slurm_env"}


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: the cores this process may run on (not the machine's, under a CPU mask),
    at most 8 (each worker's multi-rank tests start 2-4 processes of their own)."""
    return max(1, min(8, len(os.sched_getaffinity(0))))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class SlurmTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "slurm" if nodeid.startswith(SLURM_DIRS) else nodeid

    return SlurmTestsTogether(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = str(config.rootpath)
    for item in items:
        uses_slurm = SLURM_FIXTURES & set(getattr(item, "fixturenames", ()))
        if uses_slurm and not os.path.relpath(str(item.path), root).startswith(SLURM_DIRS):
            raise pytest.UsageError(
                f"{item.nodeid} uses the local SLURM cluster ({', '.join(sorted(uses_slurm))}) "
                f"outside {' and '.join(SLURM_DIRS)}: move it there, where the SLURM tests "
                "run on one xdist worker"
            )


def build_once_per_run(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]
) -> Path:
    """`build(path)` once for the whole test run, however many xdist workers ask for it: the
    first builds it under a lock in the directory the workers share, the others wait and
    reuse it. For session fixtures that tests only read (each worker is a session)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # /tmp/pytest-of-USER/pytest-N, above every worker's popen-gwK
    target, done = base / name, base / f"{name}.done"
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(target, ignore_errors=True)  # what a worker that died left
            target.mkdir()
            build(target)
            done.touch()
    return target


@pytest.fixture(scope="session")
def once_per_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`once_per_run(name, build)`: `build_once_per_run` for fixtures in other folders."""
    return functools.partial(build_once_per_run, tmp_path_factory)


@pytest.fixture(scope="session")
def default_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded default corpus (byte-level, seq_len 64), built once per run (~15 s)
    for every test that trains on it: runs and sweeps point data.remote here rather than each
    building its own copy in its run folder (what `data.remote: default` does, which the
    demo, the README run and tests/sweeps/test_sweep_run_defaults.py still exercise). Read
    it, never change it: a test that deletes or edits its data builds its own."""
    from data_tools.default_corpus import build_default_dataset

    def build(out: Path) -> None:
        build_default_dataset(str(out), seq_len=64, seed=0)

    return str(build_once_per_run(tmp_path_factory, "corpus_T64", build))


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[LocalS3]:
    """moto S3 server on 127.0.0.1 for the session; environment points boto3/streaming at it."""
    server = LocalS3().start()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in server.env().items():
            patch.setenv(key, value)
        # A developer's real profile/session token must not leak into local requests.
        for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
            patch.delenv(key, raising=False)
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: LocalS3) -> str:
    """A new, empty bucket for this test: returns "s3://<name>"."""
    return s3_endpoint.create_bucket(f"test-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def s3_env_snapshot() -> dict[str, str]:
    """The S3-related environment as the test sees it (handy for child processes)."""
    return {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "S3_"))}


# The system's temporary directory, before any test points TMPDIR elsewhere.
SYSTEM_TMP = tempfile.gettempdir()


@pytest.fixture
def private_tmpdir(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A TMPDIR of the test's own (streaming keeps filelocks and its default cache in
    tempfile.gettempdir(); sharing one between tests makes them interfere), and no
    distributed topology variables (streaming reads them; a test sets them when it needs to).
    The data and trainer tests use it for every test (autouse in their conftest.py).

    A short path directly in the system's temporary directory, not in tmp_path: DataLoader
    workers bind a Unix socket under TMPDIR, whose path may not pass 107 bytes, and
    tmp_path is /tmp/pytest-of-USER/pytest-N/popen-gwK/TEST_NAME (gpn_scale/data/loader.py
    refuses a TMPDIR that long)."""
    # pytest places its tmp_path root under tempfile.gettempdir() on first use: fix it now,
    # or (in one process, -n 0) the first test's private dir becomes every later test's root
    # and is removed under them.
    tmp_path_factory.getbasetemp()
    tmp = Path(tempfile.mkdtemp(prefix="gpn-test-", dir=SYSTEM_TMP))
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        # set-then-delete so that pytest restores "absent" after the test even if the
        # code under test (build_loader) sets them
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(autouse=True)
def _close_unclosed_loaders() -> Iterator[None]:
    """After each test, close the data loaders it left open in this process: each holds ~12
    descriptors (streaming's shared memory) and threads until closed, and the suite's process
    ran out of its 20,000 descriptors near the end of a full run."""
    yield
    from gpn_scale.data.loader import close_unclosed_loaders

    close_unclosed_loaders()
