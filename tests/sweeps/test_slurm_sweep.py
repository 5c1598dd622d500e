"""`sbatch slurm/sweep.sh SWEEP` end to end on a real local SLURM cluster, with checkpoints in a
local S3 (moto over HTTP) and W&B offline:

- the driver job submits one array (`--array=<pending>%2`); each task trains its run through
  slurm/train.sbatch (srun + torchrun, gloo on CPU);
- one task gets USR1 in its batch shell mid-run (`scancel --signal=USR1 --batch`), saves, is
  requeued by train.sbatch, resumes from S3 and finishes with per-step losses identical (==)
  to an uninterrupted twin of the same run (same seed, its own checkpoint root);
- re-running sweep.sh submits nothing; a task of a finished run exits 0 at once;
- `gpn-scale sweep status` and `gpn-scale fit` read the finished sweep.

The sweep is configs/sweeps/ci.yaml with its storage moved to S3/tmp and three tiny sizes
(an L(N) fit has three parameters, so `fit` needs >= 3 sizes per family).
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from pathlib import Path

import pytest
from sweep_helpers import REPO, events, job_env, losses, wait_for, write_sweep

from gpn_scale.train.wandb_sink import read_offline_run

pytestmark = pytest.mark.slow

SWEEP_SH = REPO / "slurm" / "sweep.sh"
TRAIN_SBATCH = REPO / "slurm" / "train.sbatch"


def _run(cmd, env, timeout=120, cwd=REPO):
    return subprocess.run(
        [str(c) for c in cmd], env=env, cwd=cwd, text=True, capture_output=True, timeout=timeout
    )


def _gpn(args, env, timeout=180):
    return _run([REPO / ".venv" / "bin" / "python", "-m", "gpn_scale.cli", *args], env, timeout)


def _queue_empty(cluster, env, *job_ids):
    out = _run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i %T"], env).stdout
    return out.strip() == ""


def _task_states(env, array_job):
    out = _run(["sacct", "-n", "-P", "-X", "-D", "-j", array_job, "-o", "JobID,State"], env).stdout
    states = {}
    for line in out.splitlines():
        job, state = line.split("|")
        m = re.match(rf"^{array_job}_(\d+)$", job)
        if m:
            states.setdefault(int(m.group(1)), []).append(state.split()[0])
    return states


@pytest.fixture
def sweep_setup(slurm_env, s3_endpoint, tmp_path, monkeypatch, default_corpus):
    bucket = s3_endpoint.create_bucket(f"sweep-{uuid.uuid4().hex[:10]}")
    wide = (
        (REPO / "configs" / "model" / "tiny.yaml").read_text().replace("d_ffn: 320", "d_ffn: 448")
    )
    assert "d_ffn: 448" in wide
    (tmp_path / "tiny_wide.yaml").write_text(wide)
    sweep = write_sweep(
        tmp_path / "ci_slurm.yaml",
        remote=default_corpus,
        checkpoint_root=f"{bucket}/ci/checkpoints",
        run_root=tmp_path / "runs",
        # three sizes of one family label: 2-layer GPN+M would be its own family, gpn+m-2l
        models=[
            {"config": "tiny"},
            {"config": "tiny", "name": "tiny_f640", "model_overrides": {"d_ffn": 640}},
            {"config": "tiny_wide.yaml"},
        ],
        overrides=["debug.step_sleep=0.3", "logging.wandb.mode=offline"],
    )
    env = job_env(
        {
            "SWEEP_GPUS": "0",
            "GPN_NPROC_PER_NODE": "1",
            "SWEEP_CONCURRENCY": "2",
            "SWEEP_CPUS": "1",
            "SWEEP_TIME": "00:15:00",
            "SWEEP_GRACE": "60",
            "SWEEP_LOG_DIR": str(tmp_path / "logs"),
            "OMP_NUM_THREADS": "1",
        }
    )
    return sweep, env, tmp_path


def test_sweep_sh_preempt_requeue_exact_skip_and_fit(sweep_setup, slurm_env):
    sweep, env, tmp = sweep_setup
    runs = json.loads(_gpn(["sweep", "plan", sweep, "--json"], env).stdout)["runs"]
    assert len(runs) == 6

    # the driver job: sbatch slurm/sweep.sh SWEEP (from the repo root, as a user would)
    proc = _run(["sbatch", "--parsable", "-o", tmp / "driver.out", SWEEP_SH, sweep], env)
    assert proc.returncode == 0, proc.stderr
    driver = proc.stdout.strip().split(";")[0]
    assert slurm_env.wait(driver, timeout=300) == "COMPLETED", (tmp / "driver.out").read_text()
    driver_out = (tmp / "driver.out").read_text()
    m = re.search(r"^ARRAY_JOB_ID=(\d+)$", driver_out, re.M)
    assert m, driver_out
    array = m.group(1)
    assert "6 of its runs (0,1,2,3,4,5)" in driver_out

    # USR1 to the batch shell of the first task that is a few steps into its run
    def progressed():
        for i, run in enumerate(runs):
            try:
                steps = losses(Path(run["run_dir"]))
            except (OSError, json.JSONDecodeError):
                continue
            if 3 <= max(steps, default=0) <= run["total_steps"] - 6:
                return str(i)
        return None

    victim = int(wait_for(progressed, 400, "a run to reach step 3"))
    # SLURM 22.05: scancel on a task of an array that still has pending tasks delivers the
    # signal, then keeps retrying ("Job is in transitional state") while the task requeues;
    # stop it once the batch shell has the signal, so it cannot hit the restarted task.
    log = tmp / "logs" / f"gpn-ci-{array}_{victim}.out"
    sig = subprocess.Popen(
        ["scancel", "--signal=USR1", "--batch", f"{array}_{victim}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: "got SIGUSR1" in log.read_text() or sig.poll() not in (None, 0),
            30,
            "the USR1 to reach the batch shell",
        )
        assert sig.poll() in (None, 0), sig.stderr.read()
    finally:
        if sig.poll() is None:
            sig.terminate()
        sig.wait()
    run0 = runs[victim]
    victim_dir = Path(run0["run_dir"])

    # the uninterrupted twin of the victim: same argv, its own checkpoint root and run dir
    argv = _gpn(["sweep", "run-argv", sweep, str(victim)], env).stdout.split("\n")
    argv = [a for a in argv if a and not a.startswith(("checkpoint.root=", "run_dir="))]
    twin_dir = tmp / "twin"
    argv += [
        f"checkpoint.root={run0['checkpoint_root'].rsplit('/', 2)[0]}/twin",
        f"run_dir={twin_dir}",
    ]
    proc = _run(
        [
            "sbatch",
            "--parsable",
            "-o",
            tmp / "twin.out",
            "--cpus-per-task=1",
            "--time=00:15:00",
            TRAIN_SBATCH,
            *argv,
        ],
        env,
    )
    assert proc.returncode == 0, proc.stderr
    twin = proc.stdout.strip().split(";")[0]
    try:
        wait_for(lambda: _queue_empty(slurm_env, env, array, twin), 600, "the array and the twin")
    except TimeoutError as err:
        queue = _run(["squeue", "-j", f"{array},{twin}", "-o", "%i %T %r"], env).stdout
        raise AssertionError(f"{err}\n{queue}") from None

    log0 = (tmp / "logs" / f"gpn-ci-{array}_{victim}.out").read_text()

    def all_completed():  # accounting may lag the controller by a moment
        states = _task_states(env, array)
        ok = sorted(states) == list(range(6)) and all(s[-1] == "COMPLETED" for s in states.values())
        return states if ok else None

    try:
        states = wait_for(all_completed, 30, "sacct to show every task COMPLETED")
    except TimeoutError:
        raise AssertionError((_task_states(env, array), log0)) from None
    assert states[victim] == ["REQUEUED", "COMPLETED"], states
    assert slurm_env.job_state(twin) == "COMPLETED", (tmp / "twin.out").read_text()
    assert "got SIGUSR1" in log0 and "requeueing job" in log0 and "restart 1" in log0, log0
    twin_log = (tmp / "twin.out").read_text()
    assert "requeueing job" not in twin_log and "restart 0" in twin_log

    # interrupted + requeued run == its uninterrupted twin, step by step
    assert events(victim_dir).count("preempted") == 1
    assert "preempted" not in events(twin_dir)
    got, want = losses(victim_dir), losses(twin_dir)
    assert sorted(want) == list(range(1, run0["total_steps"] + 1))
    assert got == want
    # the W&B run continued (same id) across the requeue: two offline segments, every step
    wb = read_offline_run(victim_dir / "wandb")
    assert len(wb.files) == 2
    wb_steps = {
        row.get("_step", row.get("step")): row["train/loss"]
        for row in wb.history
        if "train/loss" in row
    }
    assert {k: wb_steps[k] for k in want} == want

    # every run finished (DONE markers on S3): status, then fit in the background while
    # re-running sweep.sh and a task of a finished run
    out = tmp / "fit"
    fit = subprocess.Popen(
        [
            str(REPO / ".venv" / "bin" / "python"),
            "-m",
            "gpn_scale.cli",
            "fit",
            "--sweep",
            str(sweep),
            "--out",
            str(out),
            "--laws",
            "L(N)",
            "--max-starts",  # see test_families_sweep.py: the fit itself is tests/scaling's
            "8",
        ],
        env=env,
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc = _run(
        [
            "sbatch",
            "--parsable",
            "--array=1",
            "-o",
            tmp / "finished_%a.out",
            TRAIN_SBATCH,
            "--sweep",
            sweep,
        ],
        env,
    )
    assert proc.returncode == 0, proc.stderr
    finished_job = proc.stdout.strip().split(";")[0]
    status = json.loads(_gpn(["sweep", "status", sweep, "--json"], env).stdout)["runs"]
    assert [r["state"] for r in status] == ["done"] * 6
    assert [r["restarts"] for r in status] == [int(i == victim) for i in range(6)]
    assert all(r["step"] == r["total_steps"] and r["eval_loss"] > 0 for r in status)

    # re-running sweep.sh submits nothing; a task of a finished run exits 0 without training
    again = _run(["bash", SWEEP_SH, sweep], env)
    assert again.returncode == 0, again.stderr
    assert "nothing to submit" in again.stdout and "ARRAY_JOB_ID" not in again.stdout
    assert _run(["squeue", "-h", "-n", "gpn-ci", "-t", "PENDING"], env).stdout.strip() == ""
    assert slurm_env.wait(finished_job, timeout=120) == "COMPLETED"
    assert "already finished" in (tmp / "finished_1.out").read_text()

    # fit from the sweep: report, JSON, plots
    stdout, stderr = fit.communicate(timeout=300)
    assert fit.returncode == 0, stderr
    data = json.loads((out / "fit.json").read_text())
    assert [(f["family"], f["law"], f["n_points"]) for f in data["fits"]] == [("gpn+m", "L(N)", 3)]
    assert len(data["cells"]) == 3 and all(c["n"] == 2 for c in data["cells"])
    assert "## L(N)" in (out / "report.md").read_text()
    for png in ("loss_vs_N.png", "residuals.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
