"""Sweep files: expansion, the trainer contract, validation errors, `gpn-scale sweep plan`."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from gpn_scale.cli import main
from gpn_scale.models.gpn import counts
from gpn_scale.models.gpn.config import ConfigError, GPNConfig
from gpn_scale.scaling.sweep import RunSpec, expand_sweep, load_sweep, validate_with_trainer

CONTRACT_KEYS = [
    "model",
    "seed",
    "run_name",
    "optim.lr",
    "schedule.warmup_steps",
    "schedule.total_steps",
    "data.remote",
    "data.seq_len",
    "train.global_batch_size",
    "checkpoint.root",
    "logging.wandb.project",
    "logging.wandb.group",
    "logging.wandb.job_type",
]

TINY_A = GPNConfig(vocab_size=256, d_state=32, d_emb=16, d_ffn=64, n_heads=2, d_key=8, d_value=8)
TINY_B = GPNConfig(vocab_size=256, d_state=64, d_emb=16, d_ffn=128, n_heads=2, d_key=8, d_value=8)


def write_model(path, cfg: GPNConfig):
    fields = {
        k: v for k, v in cfg.to_dict().items() if k not in ("name", "norm_eps") and v is not None
    }
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in fields.items()) + "\n")


@pytest.fixture
def sweep_dir(tmp_path):
    (tmp_path / "models").mkdir()
    write_model(tmp_path / "models" / "a.yaml", TINY_A)
    write_model(tmp_path / "models" / "b.yaml", TINY_B)
    return tmp_path


BASE = """\
name: t
seeds: [0, 1, 2]
data: {remote: s3://bucket/mds, seq_len: 32}
checkpoint_root: s3://bucket/ckpt/t
wandb: {project: proj}
defaults:
  tokens_per_param: 20
  global_batch_size: 4
  lr: 1.0e-3
  warmup_steps: 2
models:
  - {config: models/a.yaml}
  - {config: models/b.yaml, lr: 5.0e-4, name: bee}
"""


def write_sweep(d, text=BASE, **edits):
    body = text
    for old, new in edits.items():
        assert old in body, old
        body = body.replace(old, new)
    path = d / "sweep.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def test_expand_gives_one_run_per_size_and_seed_with_planned_numbers(sweep_dir):
    sweep = load_sweep(write_sweep(sweep_dir))
    runs = sweep.runs
    assert [r.name for r in runs] == [f"t-a-s{s}" for s in range(3)] + [
        f"t-bee-s{s}" for s in range(3)
    ]
    r = runs[3]
    assert isinstance(r, RunSpec)
    n = counts.count_parameters(TINY_B)
    assert r.params == n and r.family == "gpn+m" and r.seed == 0 and r.lr == 5e-4
    assert r.total_steps == math.ceil(20 * n / (4 * 32)) and r.tokens == r.total_steps * 4 * 32
    assert r.flops == pytest.approx(counts.flops_per_token(TINY_B, 32) * r.tokens)
    # No hardware.mfu given: the launch accounting's prediction for this size (H100, 16/GPU).
    mfu = sweep.hardware["predicted_mfu"][r.size]
    assert 0 < mfu < 1
    assert r.gpu_hours == pytest.approx(r.flops / (989e12 * mfu) / 3600)
    assert r.checkpoint_root == "s3://bucket/ckpt/t/t-bee-s0"
    assert r.wandb_group == "t" and r.wandb_job_type == "scaling"
    assert r.model == str((sweep_dir / "models" / "b.yaml").resolve())


def test_train_overrides_use_the_contract_keys_and_the_trainer_accepts_them():
    sweep = load_sweep("ci")
    assert len(sweep.runs) == 4 and sweep.seeds == [0, 1]
    assert any("allow_few_seeds" in n for n in sweep.notes)
    r = sweep.runs[0]
    keys = [o.split("=", 1)[0] for o in r.train_overrides()]
    assert keys[: len(CONTRACT_KEYS)] == CONTRACT_KEYS
    assert f"run_name={r.name}" in r.train_overrides()
    validate_with_trainer(sweep)  # every run loads through gpn_scale.run.config

    from gpn_scale.run.config import load_train_config

    cfg = load_train_config(r.base_config, r.train_overrides())
    assert (cfg.model, cfg.seed, cfg.run_name) == ("tiny_gpn", 0, "ci-tiny_gpn-s0")
    assert cfg.schedule.total_steps == r.total_steps and cfg.optim.lr == r.lr
    assert cfg.checkpoint.root == r.checkpoint_root and cfg.logging.wandb.group == "ci"


@pytest.mark.parametrize("name", ["gpn_m_ladder", "gpn_m_isoflop"])
def test_shipped_sweeps_are_valid_and_have_three_seeds(name):
    sweep = load_sweep(name)
    validate_with_trainer(sweep)
    assert len(sweep.seeds) >= 3 and not sweep.notes
    assert sweep.total_gpu_hours > 0


def test_token_budget_lists_make_d_vary(sweep_dir):
    path = write_sweep(sweep_dir, **{"tokens_per_param: 20": "tokens_per_param: [10, 40]"})
    runs = expand_sweep(path)
    assert len(runs) == 12
    assert {r.name for r in runs if r.size == "a"} == {
        f"t-a-tpp{t}-s{s}" for t in (10, 40) for s in range(3)
    }
    fixed = write_sweep(sweep_dir, **{"tokens_per_param: 20": "tokens: 1.0e5"})
    assert {r.tokens for r in expand_sweep(fixed)} == {math.ceil(1e5 / 128) * 128}


def one_line_error(path, match, **kw):
    with pytest.raises(ConfigError) as err:
        expand_sweep(path, **kw)
    msg = str(err.value)
    assert "\n" not in msg
    assert match in msg, msg
    return msg


def test_unknown_model_config_is_a_clear_error(sweep_dir):
    path = write_sweep(sweep_dir, **{"- {config: models/a.yaml}": "- {config: gpn_m_13m}"})
    msg = one_line_error(path, "models[0].config: model config 'gpn_m_13m' not found")
    assert "did you mean 'gpn_m_130m'?" in msg


def test_duplicate_run_names_are_a_clear_error(sweep_dir):
    path = write_sweep(sweep_dir, **{"name: bee": "name: a"})
    one_line_error(
        path,
        "duplicate run name 't-a-s0' (models[0] and models[1]); give one of them a distinct `name`",
    )


def test_fewer_than_three_seeds_needs_the_explicit_override(sweep_dir):
    path = write_sweep(sweep_dir, **{"seeds: [0, 1, 2]": "seeds: [0, 1]"})
    one_line_error(path, "seeds: 2 seed(s) but a sweep needs >= 3")
    assert len(expand_sweep(path, allow_few_seeds=True)) == 4
    path = write_sweep(sweep_dir, **{"seeds: [0, 1, 2]": "seeds: [0, 1]\nallow_few_seeds: true"})
    assert len(expand_sweep(path)) == 4


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"seeds: [0, 1, 2]": "seed: [0, 1, 2]"}, "seed: unknown key (did you mean 'seeds'?)"),
        ({"seeds: [0, 1, 2]": "seeds: [0, 1, 1]"}, "seeds: seed 1 is listed twice"),
        (
            {"  lr: 1.0e-3\n": "  lr: 1.0e-3\n  lrr: 2\n"},
            "defaults.lrr: unknown key (did you mean 'lr'?)",
        ),
        ({"warmup_steps: 2": "warmup_steps: 100000"}, "warmup_steps 100000 >= total steps"),
        ({"s3://bucket/mds": "gs://bucket/mds"}, "data.remote: unsupported scheme 'gs://'"),
        ({"checkpoint_root: s3://bucket/ckpt/t\n": ""}, "checkpoint_root: required"),
        (
            {"tokens_per_param: 20": "tokens_per_param: 20\n  tokens: 1e6"},
            "exactly one of tokens_per_param or tokens",
        ),
        ({"wandb: {project: proj}": "wandb: {}"}, "wandb.project: required"),
        ({"lr: 5.0e-4": "lr: -1"}, "models[1].lr: expected a positive number"),
    ],
)
def test_bad_sweeps_fail_with_one_line(sweep_dir, edit, match):
    one_line_error(write_sweep(sweep_dir, **edit), match)


def test_trainer_schema_is_checked_at_plan_time(sweep_dir):
    path = write_sweep(
        sweep_dir, **{"warmup_steps: 2": "warmup_steps: 2\n  overrides: [optim.lrr=1]"}
    )
    with pytest.raises(ConfigError, match=r"run 't-a-s0': the trainer rejects its config: .*lrr"):
        validate_with_trainer(load_sweep(path))


def test_plan_command_prints_runs_and_totals(sweep_dir, capsys):
    path = write_sweep(sweep_dir)
    assert main(["sweep", "plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "6 runs = 2 size/budget cells x 3 seeds" in out
    for s in range(3):
        assert f"t-bee-s{s}" in out
    assert "GPU-hours" in out
    assert main(["sweep", "plan", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["runs"]) == 6 and data["runs"][0]["train_overrides"][0].startswith("model=")


def test_plan_command_errors_are_one_line(sweep_dir, capsys):
    path = write_sweep(sweep_dir, **{"seeds: [0, 1, 2]": "seeds: [0]"})
    assert main(["sweep", "plan", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gpn-scale: error: seeds: 1 seed(s)") and "\n" not in err
    assert main(["sweep", "plan", str(path), "--allow-few-seeds"]) == 0
    assert "NOTE: only 1 seed(s)" in capsys.readouterr().out


def test_relative_paths_are_taken_from_the_sweep_file_and_planned_absolute(
    sweep_dir, tmp_path, monkeypatch, capsys
):
    """Relative local paths mean 'beside the sweep file', wherever `plan`, `sweep.sh` or a job
    runs from; `sweep plan` prints them absolute."""
    from gpn_scale.cli import main

    path = write_sweep(
        sweep_dir,
        **{
            "remote: s3://bucket/mds": "remote: data/mds",
            "checkpoint_root: s3://bucket/ckpt/t": "checkpoint_root: out/ckpt\nrun_root: out/runs",
        },
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = load_sweep(path).runs[0]
    assert r.data_remote == str(sweep_dir / "data" / "mds")
    assert r.checkpoint_root == str(sweep_dir / "out" / "ckpt" / r.name)
    assert r.run_dir == str(sweep_dir / "out" / "runs" / r.name)
    assert f"data.remote={sweep_dir / 'data' / 'mds'}" in r.train_overrides()
    assert main(["sweep", "plan", "../sweep.yaml"]) == 0  # given relative to the cwd
    out = capsys.readouterr().out
    assert f"sweep t ({path})" in out
    assert f"data {sweep_dir / 'data' / 'mds'} " in out
    assert f"checkpoints {sweep_dir / 'out' / 'ckpt'}/<run>" in out
    assert f"run dirs {sweep_dir / 'out' / 'runs'}/<run>" in out


@pytest.mark.parametrize(
    "text,minutes",
    [
        ("90", 90),
        ("24:00:00", 1440),
        ("1-00:00:00", 1440),
        ("10:30", 11),
        ("2-3", 3060),
        ("1-2:30", 1590),
    ],
)
def test_sweep_submit_time_reads_sbatch_formats_like_sweep_sh(text, minutes):
    """`sweep submit -t` and `slurm/sweep.sh -t` take the same values (sbatch --time's)."""
    from gpn_scale.cli import build_parser

    for flag in ("-t", "--time", "--time-min"):
        assert (
            build_parser().parse_args(["sweep", "submit", "s.yaml", flag, text]).time_min == minutes
        )


def test_sweep_sh_time_is_checked_and_passed_to_sbatch(tmp_path):
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "GPN_SCALE_PYTHON": sys.executable,
        "PYTHONPATH": str(repo),
        "SWEEP_LOG_DIR": str(tmp_path / "logs"),
    }
    env.pop("SLURM_JOB_ID", None)

    def sweep_sh(*args):
        return subprocess.run(
            [
                "bash",
                str(repo / "slurm" / "sweep.sh"),
                "configs/sweeps/ci.yaml",
                "--dry-run",
                *args,
            ],
            cwd=repo,
            env=env,
            text=True,
            capture_output=True,
            timeout=120,
        )

    bad = sweep_sh("-t", "24h")
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "sweep.sh: error: --time: minutes or [D-]HH:MM:SS (as sbatch --time), got '24h'"
    )
    ok = sweep_sh("-t", "90")
    assert ok.returncode == 0, ok.stderr
    assert " --time=90 " in ok.stdout


@pytest.mark.parametrize("name", ["gpn_m_ladder", "gpn_m_isoflop"])
def test_shipped_sweeps_checkpoint_periodically_and_log_to_wandb(name):
    from gpn_scale.run.config import load_train_config

    for r in load_sweep(name, price=False).runs:
        cfg = load_train_config(r.base_config, r.train_overrides())
        # every 5% of the run: at most 1/20 of it lost to a node failure
        assert cfg.checkpoint.every_steps == math.ceil(r.total_steps / 20) > 0
        assert cfg.logging.wandb.mode == "auto"
        assert cfg.logging.wandb.run_id == r.wandb_run_id


def test_wandb_run_id_is_stable_and_distinct_per_run():
    a, b = load_sweep("ci").runs[:2], load_sweep("ci").runs[:2]
    assert [r.wandb_run_id for r in a] == [r.wandb_run_id for r in b]
    assert a[0].wandb_run_id != a[1].wandb_run_id
    assert a[0].wandb_run_id.startswith(a[0].name)


def test_sweep_checkpoint_every_and_wandb_mode_are_checked(sweep_dir):
    one_line_error(
        write_sweep(sweep_dir, **{"wandb: {project: proj}": "wandb: {project: proj, mode: loud}"}),
        "wandb.mode: one of",
    )
    bad = {"wandb: {project: proj}": "wandb: {project: proj}\ncheckpoint_every_steps: -1"}
    one_line_error(write_sweep(sweep_dir, **bad), "checkpoint_every_steps")
    ok = {"wandb: {project: proj}": "wandb: {project: proj}\ncheckpoint_every_steps: 7"}
    sweep = load_sweep(write_sweep(sweep_dir, **ok), price=False)
    assert {r.checkpoint_every_steps for r in sweep.runs} == {7}


def test_sweep_plan_into_a_closed_pipe_exits_quietly(tmp_path):
    """`gpn-scale sweep plan … | head` used to end in a BrokenPipeError traceback."""
    import fcntl
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    fcntl.fcntl(write, 1031, 4096)  # F_SETPIPE_SZ: a small pipe, so the writer must wait
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpn_scale", "sweep", "plan", "families_ladder", "--overrides"],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write)
    with os.fdopen(read) as reader:
        assert reader.readline().startswith("sweep families-ladder")  # what `head -1` reads
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
