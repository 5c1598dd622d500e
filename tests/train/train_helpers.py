"""Shared helpers for the trainer tests (tests/train, tests/parallel).

Runs go through the real CLI: `python -m gpn_scale train …` in a subprocess (or under
`torch.distributed.run` for 2 gloo ranks), with OMP_NUM_THREADS=1, a private TMPDIR
(streaming's filelocks) and the extension build cache that tests/conftest.py sets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpn_scale.train.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
SEQ_LEN = 64


def build_corpus(base: Path) -> str:
    """The embedded default corpus at SEQ_LEN, built once per test session (reused if present)."""
    from data_tools.default_corpus import build_default_dataset

    return build_default_dataset(str(base / f"corpus_T{SEQ_LEN}"), seq_len=SEQ_LEN, seed=0)


def child_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    tmpdir = tmp / "tmp"
    tmpdir.mkdir(parents=True, exist_ok=True)
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "TMPDIR": str(tmpdir),
            "PYTHONUNBUFFERED": "1",
            "WANDB_SILENT": "true",
        }
    )
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_JOB_ID",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        # the token of this process's W&B service (set by an earlier in-process W&B run): a
        # trainer started from a shell starts its own
        "WANDB_SERVICE",
    ):
        env.pop(key, None)
    env.update(extra)
    return env


def train_args(corpus: str, run_dir: Path, *overrides: str, config: str = "ci_tiny") -> list[str]:
    return [
        "train",
        config,
        f"data.remote={corpus}",
        f"data.seq_len={SEQ_LEN}",
        f"run_dir={run_dir}",
        *overrides,
    ]


def cli(nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [PY, "-m", "gpn_scale"]
    return [
        PY,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "gpn_scale",
    ]


def run_train(
    corpus: str,
    run_dir: Path,
    *overrides: str,
    nproc: int = 1,
    resume: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess:
    cmd = cli(nproc) + train_args(corpus, run_dir, *overrides)
    if resume:
        cmd += ["--resume", resume]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=env or child_env(run_dir.parent),
        text=True,
        capture_output=True,
        timeout=timeout,
    )
    log = run_dir.parent / f"{run_dir.name}.{'resume' if resume else 'train'}.log"
    with open(log, "a") as fh:  # kept for post-mortems of failed runs
        fh.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\nexit {proc.returncode}\n")
    if check and proc.returncode != 0:
        errors = "\n".join(
            line
            for line in (proc.stdout + proc.stderr).splitlines()
            if "rror" in line and "Warning" not in line
        )
        raise AssertionError(
            f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-3000:]}\nerror lines:\n{errors[-6000:]}"
        )
    return proc


def start_train(
    corpus: str,
    run_dir: Path,
    *overrides: str,
    resume: str | None = None,
    env: dict[str, str] | None = None,
    new_session: bool = False,
) -> subprocess.Popen:
    """new_session: the trainer leads its own process group (kill it whole with killpg, as
    SLURM or a container runtime does: its helper processes die with it)."""
    cmd = cli(1) + train_args(corpus, run_dir, *overrides)
    if resume:
        cmd += ["--resume", resume]
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env or child_env(run_dir.parent),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=new_session,
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl", live=True)  # the run may be writing it


def train_losses(run_dir: Path) -> dict[int, float]:
    return {
        r["step"]: r["train/loss"] for r in read_metrics(run_dir) if r.get("train/loss") is not None
    }


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 180) -> int:
    """Block until metrics.jsonl shows a train line at >= step; returns the step seen."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        seen = max(train_losses(run_dir), default=0)
        if seen >= step:
            return seen
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early ({proc.returncode}):\n{proc.stdout.read()}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"step {step} not reached in {timeout}s")


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def grad_norms(run_dir: Path) -> dict[int, float]:
    return {
        r["step"]: r["grad_norm"] for r in read_metrics(run_dir) if r.get("grad_norm") is not None
    }


def weight_distance(a: dict, b: dict, init: dict) -> tuple[float, float]:
    """(|a-b| / |a-init| over all weights, max |a-b|): how far two trainings ended apart,
    relative to how far training moved the weights. Adam turns reduction-order noise in
    near-zero gradients into weight differences of a few 1e-6..1e-5 after a few steps;
    a real mistake (a lost shard, a wrong batch) is of the order of the movement itself."""
    import torch

    diff = torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a))
    move = torch.sqrt(sum(((a[k] - init[k]) ** 2).sum() for k in a))
    return float(diff / move), max(float((a[k] - b[k]).abs().max()) for k in a)


def initial_weights(model: str = "tiny", seed: int = 0) -> dict:
    """The weights a run of `model` (any registered family) starts from with `seed`."""
    import torch

    from gpn_scale.models.registry import load_model_config

    spec, cfg = load_model_config(model)
    torch.manual_seed(seed)
    return spec.build(cfg).state_dict()
