"""The mixed-family smoke sweep end to end on the local SLURM cluster: `sbatch slurm/sweep.sh
configs/sweeps/families_smoke.yaml` (its storage moved to tmp) trains every run of all five
families (GPN+M 1- and 2-layer, GPN, Transformer++, Gated DeltaNet; three tiny widths, one
seed) as one job array, and `gpn-scale fit` over the finished sweep writes a report with every
family and their gaps to GPN+M.

Needs the Transformer++ and Gated DeltaNet families registered and trainable (their model
configs transformer_pp_tiny / gated_deltanet_tiny and the registry-driven trainer).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from sweep_helpers import REPO, job_env, wait_for

pytestmark = pytest.mark.slow

SMOKE = REPO / "configs" / "sweeps" / "families_smoke.yaml"
FAMILIES = {"gpn+m", "gpn+m-2l", "gpn", "transformer_pp", "gated_deltanet"}


def _run(cmd, env, timeout=300):
    return subprocess.run(
        [str(c) for c in cmd], env=env, cwd=REPO, text=True, capture_output=True, timeout=timeout
    )


def _gpn(args, env, timeout=300):
    return _run([sys.executable, "-m", "gpn_scale.cli", *args], env, timeout)


def test_mixed_family_sweep_through_sweep_sh_ends_in_a_fit_with_every_familys_gaps(
    slurm_env, tmp_path, default_corpus
):
    raw = OmegaConf.to_container(OmegaConf.load(SMOKE))
    # The session's one built corpus (the smoke sweep's `default` builds one per run folder:
    # 15 builds of ~15 s on this machine, a third of the test's time).
    raw["data"]["remote"] = default_corpus
    # W&B is read back by test_slurm_sweep.py; here it would add ~3 s to each of 15 runs
    raw["wandb"]["mode"] = "disabled"
    raw["checkpoint_root"] = str(tmp_path / "checkpoints")
    raw["run_root"] = str(tmp_path / "runs")
    sweep = tmp_path / "families_smoke.yaml"
    sweep.write_text(OmegaConf.to_yaml(OmegaConf.create(raw)))
    env = job_env(
        {
            "SWEEP_GPUS": "0",
            "GPN_NPROC_PER_NODE": "1",
            "SWEEP_CONCURRENCY": "2",
            "SWEEP_CPUS": "1",
            "SWEEP_TIME": "00:15:00",
            "SWEEP_LOG_DIR": str(tmp_path / "logs"),
            "OMP_NUM_THREADS": "1",
            # the jobs run this checkout with this interpreter (a worktree's venv may be an
            # editable install of another checkout)
            "GPN_SCALE_PYTHON": sys.executable,
            "PYTHONPATH": str(REPO),
        }
    )
    plan = _gpn(["sweep", "plan", sweep, "--json"], env)
    assert plan.returncode == 0, plan.stderr
    runs = json.loads(plan.stdout)["runs"]
    assert {r["family"] for r in runs} == FAMILIES and len(runs) == 15

    proc = _run(
        ["sbatch", "--parsable", "-o", tmp_path / "driver.out", REPO / "slurm" / "sweep.sh", sweep],
        env,
    )
    assert proc.returncode == 0, proc.stderr
    driver = proc.stdout.strip().split(";")[0]
    assert slurm_env.wait(driver, timeout=180) == "COMPLETED", (tmp_path / "driver.out").read_text()
    m = re.search(r"^ARRAY_JOB_ID=(\d+)$", (tmp_path / "driver.out").read_text(), re.M)
    assert m, (tmp_path / "driver.out").read_text()
    array = m.group(1)

    def finished():
        out = _run(["squeue", "-h", "-j", array, "-o", "%i %T"], env).stdout
        return out.strip() == ""

    wait_for(finished, 1500, "the sweep's job array", poll=2.0)
    status = json.loads(_gpn(["sweep", "status", sweep, "--json", "--no-scheduler"], env).stdout)
    states = {r["name"]: r["state"] for r in status["runs"]}
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((tmp_path / "logs").glob("*.out")))
    assert set(states.values()) == {"done"}, (states, logs)

    out = tmp_path / "fit"
    # --max-starts: 3 sizes for 3 parameters interpolate, and L-BFGS from all 150 grid points
    # of the protocol spends ~17 s per law and family on that (~3 min of this test); the fit
    # itself is tests/scaling's, this test is the path launch -> collect -> fit -> gaps
    fit = _gpn(
        ["fit", "--sweep", sweep, "--out", out, "--laws", "L(N)", "L(C)", "--max-starts", "8"],
        env,
    )
    assert fit.returncode == 0, fit.stderr
    data = json.loads((out / "fit.json").read_text())
    assert {(f["family"], f["law"]) for f in data["fits"]} == {
        (fam, law) for fam in FAMILIES for law in ("L(N)", "L(C)")
    }
    assert all(c["n"] == 1 for c in data["cells"]) and len(data["cells"]) == 15
    gaps = data["gaps"]
    assert gaps["reference"] == "gpn+m"
    assert {(g["family"], g["measure"]) for g in gaps["gaps"]} == {
        (fam, m)
        for fam in FAMILIES - {"gpn+m"}
        for m in ("loss_ratio_N", "loss_ratio_C", "compute_multiplier")
    }
    for g in gaps["gaps"]:
        if g["measure"] != "compute_multiplier":  # a multiplier may be unreachable (null)
            assert g["value"] > 0, g
    report = (out / "report.md").read_text()
    assert "## Gaps against gpn+m" in report
    for fam in FAMILIES - {"gpn+m"}:
        assert f"| {fam} | loss ratio at equal C |" in report
    assert Path(out / "loss_vs_C.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
