"""`gpn-scale sweep submit` (submitit) on a real cluster's terms (issue 17): many time limits
are allowed, a SIGTERM preemption (trainer exit 75) requeues the job instead of ending it
FAILED, and a stale MASTER_ADDR/MASTER_PORT from the submitting shell is not handed on."""

from __future__ import annotations

import subprocess

import pytest

from gpn_scale.scaling import submit
from gpn_scale.scaling.slurm_launch import load
from gpn_scale.scaling.submit import MAX_NUM_TIMEOUT, SubmitOptions, TrainRun


def test_executor_allows_many_time_limits(tmp_path):
    sweep = load("ci")
    kind, ex = submit.make_executor(sweep, SubmitOptions(executor="slurm", folder=str(tmp_path)))
    assert kind == "slurm" and MAX_NUM_TIMEOUT >= 100
    assert ex._executor.max_num_timeout == MAX_NUM_TIMEOUT


def test_stale_rendezvous_is_not_handed_to_the_trainer():
    stale = {"SLURM_JOB_ID": "7", "MASTER_ADDR": "old-node", "MASTER_PORT": "29500", "A": "1"}
    assert TrainRun.child_env(stale) == {"SLURM_JOB_ID": "7", "A": "1"}
    torchrun = {**stale, "RANK": "0"}  # torchrun's own values are kept
    assert TrainRun.child_env(torchrun) == torchrun
    assert TrainRun.child_env({"MASTER_ADDR": "h"}) == {"MASTER_ADDR": "h"}  # not under SLURM


def test_sigterm_preemption_requeues_instead_of_failing(monkeypatch):
    calls = []

    class Exited(Exception):
        pass

    def fake_exit(code):
        raise Exited(code)

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setattr(submit.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(submit.os, "_exit", fake_exit)
    monkeypatch.setattr(
        submit.subprocess,
        "run",
        lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0),
    )
    run = TrainRun(["ci_tiny"], python="python-that-exits-75")
    monkeypatch.setattr(
        submit.subprocess,
        "Popen",
        lambda *a, **kw: type("P", (), {"poll": lambda self: 75, "returncode": 75})(),
    )
    with pytest.raises(Exited) as out:
        run()
    assert out.value.args == (0,) and calls == [["scontrol", "requeue", "4242"]]
