"""The run config (gpn_scale/run/config*.py): its schema, keys, values and overrides (fast,
in-process)."""

from __future__ import annotations

import pytest
import torch

from gpn_scale.core.config import ConfigError
from gpn_scale.models.gpn import load_model_config
from gpn_scale.run.config import all_keys, batch_layout, load_train_config


def test_every_shipped_config_loads():
    for name in ("ci_tiny", "demo", "small", "paper_130m"):
        cfg = load_train_config(name)
        load_model_config(cfg.model)  # the model it names exists


def test_sweep_keys_are_in_the_schema():
    """Every key a sweep run passes to the trainer (scaling/sweep_spec.py writes them; their
    order is tests/scaling/test_sweep.py's) is a key of the schema."""
    from gpn_scale.scaling.sweep import load_sweep

    keys = set(all_keys())
    for run in load_sweep("ci").runs:
        for override in run.train_overrides():
            key = override.split("=", 1)[0]
            assert key in keys or key.startswith("model_overrides."), key
    cfg = load_train_config(
        "ci_tiny",
        [
            "model=small",
            "seed=3",
            "optim.lr=1e-3",
            "logging.wandb.group=g",
            "checkpoint.root=s3://b/p",
        ],
    )
    assert (cfg.model, cfg.seed, cfg.optim.lr, cfg.logging.wandb.group) == ("small", 3, 1e-3, "g")
    assert cfg.resolved_checkpoint_root == "s3://b/p"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optim.lrr=1", "optim.lrr: unknown config key (did you mean 'optim.lr'?)"),
        ("train.global_batch=8", "did you mean 'train.global_batch_size'?"),
        ("schedule.warmup=3", "did you mean 'schedule.warmup_steps'?"),
        ("logging.wandb.projetc=x", "did you mean 'logging.wandb.project'?"),
        ("parallel.backend=fsdp", "did you mean 'fsdp2'?"),
        ("train.precision=fp16", "train.precision: expected one of auto, fp32, bf16"),
        (
            "schedule.warmup_steps=100",
            "schedule.warmup_steps: must be in [0, schedule.total_steps=8]",
        ),
        ("train.deterministic=sometimes", "train.deterministic: expected auto, true or false"),
        ("engine.chunk_sise=8", "did you mean 'engine.chunk_size'?"),
        ("engine.chunk_size=0", "engine.chunk_size: must be >= 1, got 0"),
        ("engine.step_backend=gpu", "engine.step_backend: expected auto, reference, cpu or cuda"),
    ],
)
def test_bad_keys_and_values_fail_in_one_line(override, expected):
    with pytest.raises(ConfigError) as err:
        load_train_config("ci_tiny", [override])
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_the_runs_engine_section_wins_over_the_model_files_options():
    from gpn_scale.run.model import model_config

    default = model_config(load_train_config("ci_tiny"))
    assert default.engine == load_model_config(default.name).engine  # none set: the model's
    cfg = load_train_config("ci_tiny", ["engine.chunk_size=5", "engine.step_backend=reference"])
    model_cfg = model_config(cfg)
    assert model_cfg.engine == default.engine.replace(chunk_size=5, step_backend="reference")
    assert model_cfg.replace(engine=default.engine) == default  # the shape is untouched


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  weight_decya: 0.1\n")
    with pytest.raises(
        ConfigError,
        match=r"optim.weight_decya: unknown config key \(did you mean 'optim.weight_decay'\?\)",
    ):
        load_train_config(path)


def test_batch_layout():
    cfg = load_train_config("ci_tiny", ["train.global_batch_size=16", "train.micro_batch_size=2"])
    assert batch_layout(cfg, 1) == (2, 8)
    assert batch_layout(cfg, 2) == (2, 4)
    with pytest.raises(ConfigError, match="not divisible by the world size 3"):
        batch_layout(cfg, 3)


def test_cli_options_anywhere_among_overrides():
    from gpn_scale.cli import build_parser

    parser = build_parser()
    for argv in (
        ["train", "ci_tiny", "a=1", "b=2", "--resume", "auto"],
        ["train", "ci_tiny", "--resume", "auto", "a=1", "b=2"],
        ["train", "ci_tiny", "a=1", "--resume", "auto", "b=2"],
    ):
        args = parser.parse_args(argv)
        assert (args.config, args.overrides, args.resume) == ("ci_tiny", ["a=1", "b=2"], "auto")


def test_config_name_not_shadowed_by_a_directory(tmp_path, monkeypatch):
    (tmp_path / "demo").mkdir()  # e.g. an old run directory called demo
    monkeypatch.chdir(tmp_path)
    assert load_train_config("demo").run_name == "demo"
    with pytest.raises(ConfigError, match="not found"):
        load_train_config("./nope.yaml")


def test_train_config_positional_is_optional_for_override_only_runs():
    """Sweep runs without a base config call `gpn-scale train key=value ...`."""
    import argparse

    from gpn_scale.app.commands import _config_and_overrides

    only = argparse.Namespace(config="model=tiny", overrides=["seed=3"])
    assert _config_and_overrides(only) == (None, ["model=tiny", "seed=3"])
    named = argparse.Namespace(config="ci_tiny", overrides=["seed=3"])
    assert _config_and_overrides(named) == ("ci_tiny", ["seed=3"])
    cfg = load_train_config(*_config_and_overrides(only))
    assert cfg.model == "tiny" and cfg.seed == 3


@pytest.mark.parametrize(
    "value, cpu, cuda", [("auto", True, False), (True, True, True), (False, False, False)]
)
def test_deterministic_auto_is_on_for_cpu_off_for_cuda(value, cpu, cuda, monkeypatch):
    """The default: deterministic on CPU (exact resume), not on GPU (NaN-filled torch.empty,
    slow kernels); explicit true/false honoured. No GPU needed: nothing touches the device."""
    from gpn_scale.train import determinism

    assert load_train_config(None).train.deterministic == "auto"
    cfg = load_train_config(None, [f"train.deterministic={str(value).lower()}"])
    assert cfg.train.deterministic == value
    calls = []
    monkeypatch.setattr(
        torch, "use_deterministic_algorithms", lambda on, warn_only=False: calls.append(on)
    )
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert determinism.set_determinism(cfg, torch.device("cpu")) is cpu
    assert determinism.set_determinism(cfg, torch.device("cuda", 0)) is cuda
    assert calls == [True] * (cpu + cuda)


@pytest.mark.parametrize(
    "override",
    ["optim.lr=nan", "optim.lr=inf", "optim.weight_decay=-inf", "checkpoint.lease_ttl_s=nan"],
)
def test_non_finite_numbers_are_refused_naming_the_key(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        load_train_config("ci_tiny", [override])
    msg = str(err.value)
    assert msg.startswith(f"{key}: must be a finite number, got ") and "\n" not in msg


@pytest.mark.parametrize(
    "override, off",
    [
        ("checkpoint.every_steps=-1", "(0 = only on preemption and at the end)"),
        ("eval.every_steps=-5", "(0 = only at the end)"),
        ("optim.grad_clip=-1", "(0 = no clipping)"),
        ("checkpoint.lease_ttl_s=-3", "(0 = no lease)"),
        ("preemption.end_margin_s=-60", "(0 = off)"),
        ("analysis.every_steps=-1", "(0 = off)"),
        ("data.shuffle_seed=-1", ""),
        ("seed=-2", ""),
        ("debug.inject_nan_steps=[3,-1]", ""),
    ],
)
def test_negative_numbers_are_refused_never_read_as_off(override, off):
    """One rule for every number of the schema: 0 is off where a key has an off, and a
    negative value is refused in one line naming the key (it used to mean off for some keys,
    every step for others)."""
    key = override.split("=")[0].replace("[3,-1]", "")
    with pytest.raises(ConfigError) as err:
        load_train_config("ci_tiny", [override])
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(key) and "must be >= 0" in msg, msg
    assert off in msg and msg.endswith("negative numbers are never read as off")
    assert load_train_config("ci_tiny", [f"{key.split('[')[0]}=0"] if "[" not in override else [])


def test_tilde_in_a_path_key_is_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_train_config("ci_tiny", ["run_dir=~/runs/x", "checkpoint.root=~/ck"])
    assert cfg.run_dir == str(tmp_path / "runs" / "x")
    assert cfg.resolved_checkpoint_root == str(tmp_path / "ck")
    with pytest.raises(ConfigError, match=r"run_dir=~nosuchuser_gpn/x: cannot expand"):
        load_train_config("ci_tiny", ["run_dir=~nosuchuser_gpn/x"])
