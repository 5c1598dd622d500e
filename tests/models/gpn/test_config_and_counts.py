"""Model config validation, the shipped YAML configs, and the parameter/FLOP counts."""

import subprocess
import sys

import pytest
import torch

from gpn_scale.models.gpn import GPN, ConfigError, GPNConfig, load_model_config
from gpn_scale.models.gpn.counts import (
    count_parameters,
    estimate_training_memory,
    flops_per_token,
    forward_flops_per_token,
)
from gpn_scale.models.registry import CONFIG_DIR
from gpn_scale.ops.gpn_step.options import EngineOptions

BASE = dict(vocab_size=100, d_state=16, d_emb=8, d_ffn=24, n_heads=2, d_key=4, d_value=6)


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(d_state=-4), "d_state"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(d_ffn=2.5), "d_ffn"),
        (dict(n_heads=0), "n_heads"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(tbptt=-1), "tbptt"),
        (dict(memory_cells=1000), "memory_cells"),
        (dict(memory=False), "n_heads"),
        (dict(memory="yes"), "memory"),
    ],
)
def test_bad_values_name_the_field(changes, field):
    with pytest.raises(ConfigError) as err:
        GPNConfig.from_dict({**BASE, **changes})  # as a model YAML spells them
    message = str(err.value)
    assert message.startswith(field) and "\n" not in message


def test_unknown_and_missing_keys():
    with pytest.raises(
        ConfigError, match=r"model.d_stat: unknown key \(did you mean 'd_state'\?\)"
    ):
        GPNConfig.from_dict({**BASE, "d_stat": 3})
    values = dict(BASE)
    del values["d_emb"]
    with pytest.raises(ConfigError, match="model.d_emb: required"):
        GPNConfig.from_dict(values)


def test_engine_options_are_one_section_spelled_flat_or_nested():
    """The execution options live in `engine` (EngineOptions), not among the shape fields; a
    model YAML spells them flat, a written config nests them, and both read the same."""
    flat = GPNConfig.from_dict({**BASE, "chunk_size": 8, "step_backend": "reference"})
    nested = GPNConfig.from_dict({**BASE, "engine": {"chunk_size": 8, "step_backend": "reference"}})
    assert flat == nested
    assert flat.engine == EngineOptions(chunk_size=8, step_backend="reference")
    assert "chunk_size" not in GPNConfig.field_names() and "engine" in flat.to_dict()
    assert GPNConfig.from_dict(flat.to_dict()) == flat  # what a checkpoint records reads back
    assert flat.replace(chunk_size=4).engine.chunk_size == 4  # replace takes an option by name
    assert flat.replace(chunk_size=4).engine.step_backend == "reference"
    same = GPNConfig.from_dict({**BASE, "chunk_size": 8, "engine": {"chunk_size": 8}})
    assert same == GPNConfig.from_dict({**BASE, "chunk_size": 8})


@pytest.mark.parametrize(
    "value, projections",
    [
        ("none", set()),
        ("", set()),
        ("all", {"input", "input_dx", "down", "down_dx", "fuse_gate", "fuse_gate_dx"}),
        ("down_dx", {"down_dx"}),
        (" input, fuse_gate_dx ", {"input", "fuse_gate_dx"}),
    ],
)
def test_cublas_gemms_names_the_projections_it_sends_through_cublas(value, projections):
    options = GPNConfig.from_dict({**BASE, "engine": {"cublas_gemms": value}}).engine
    assert options.cublas_projections() == projections
    assert EngineOptions().cublas_projections() == set()  # the default: every GEMM Triton's


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"chunk_size": 8, "engine": {"chunk_size": 16}},
            "model.chunk_size: 8 and model.engine.chunk_size: 16 disagree; set the option once",
        ),
        ({"engine": {"chunk_sise": 8}}, "model.engine.chunk_sise: unknown engine option"),
        ({"engine": {"cuda_graphs": "yes"}}, "cuda_graphs: expected true or false, got 'yes'"),
        ({"engine": 3}, "model.engine: expected a section of keys, got 3"),
        (
            {"engine": {"cublas_gemms": "down_dx,fuse"}},
            "cublas_gemms: unknown projection 'fuse'; expected comma-separated "
            "input, input_dx, down, down_dx, fuse_gate, fuse_gate_dx, or all, or none",
        ),
        (
            {"engine": {"cublas_gemms": ["down_dx"]}},
            "cublas_gemms: expected comma-separated projections, all or none, got ['down_dx']",
        ),
    ],
)
def test_bad_engine_sections_are_one_line(values, message):
    with pytest.raises(ConfigError) as err:
        GPNConfig.from_dict({**BASE, **values})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_heads_must_match_the_declared_cell_count():
    GPNConfig(**BASE, memory_cells=2 * 4 * 6)
    with pytest.raises(ConfigError, match="memory_cells: 47 does not match n_heads"):
        GPNConfig(**BASE, memory_cells=47)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_configs_load(path):
    """Every family's configs, each with its own config class (models/registry.py)."""
    from gpn_scale.models.registry import load_model_config as load_any

    spec, cfg = load_any(path.stem)
    assert cfg.name == path.stem and spec.count_parameters(cfg) > 0
    if spec.name != "gpn":  # GPN's own loader names the family it cannot read
        with pytest.raises(ConfigError, match=rf"model.family: {spec.name!r} is not GPN"):
            load_model_config(path.stem)


def test_paper_configurations_have_the_published_sizes():
    one = load_model_config("gpn_m_130m")
    assert (one.cells, round(count_parameters(one) / 1e6, 1)) == (491_520, 129.2)
    two = load_model_config("gpn_m_130m_2l")
    assert (two.cells, round(count_parameters(two) / 1e6, 1), two.tbptt) == (360_448, 129.8, 512)
    gpn = load_model_config("gpn_130m")
    assert (gpn.cells, round(count_parameters(gpn) / 1e6, 1)) == (0, 129.2)


@pytest.mark.parametrize(
    "changes",
    [
        dict(),
        dict(n_layers=3, decoder_bias=True),
        dict(memory=False, n_heads=0, d_key=0, d_value=0),
    ],
)
def test_counts_match_the_module(changes):
    cfg = GPNConfig(**{**BASE, **changes})
    assert count_parameters(cfg) == GPN(cfg).num_parameters()


def test_flops_count_matches_profiled_matmuls():
    """Count the forward's matmul FLOPs with torch's FLOP counter on the reference path."""
    from torch.utils.flop_counter import FlopCounterMode

    from gpn_scale.models.gpn.reference import reference_forward

    cfg = GPNConfig(**{**BASE, "n_layers": 2})
    model = GPN(cfg)
    B, T = 2, 5
    tokens = torch.randint(0, cfg.vocab_size, (B, T))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        reference_forward(model, tokens)
    per_token = counter.get_total_flops() / (B * T)
    # The reference's memory einsums are partly elementwise (not counted by the profiler):
    # count those by hand: the rank-1 write, i.e. H*dk*dv MACs per token.
    H, dk, dv = cfg.n_heads, cfg.d_key, cfg.d_value
    assert per_token + 2 * H * dk * dv == pytest.approx(forward_flops_per_token(cfg), rel=1e-9)
    assert flops_per_token(cfg, 2048) == 3 * forward_flops_per_token(cfg)


def test_memory_estimate_grows_with_batch():
    cfg = load_model_config("gpn_m_130m")
    small = estimate_training_memory(cfg, 1, 2048)
    big = estimate_training_memory(cfg, 16, 2048)
    assert 5 * small.activations_bytes < big.activations_bytes < 16 * small.activations_bytes
    assert small.training_state_bytes == count_parameters(cfg) * 12


def test_info_command_prints_counts():
    out = subprocess.run(
        [sys.executable, "-m", "gpn_scale", "info", "gpn_m_130m"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "129,151,902" in out and "491,520" in out and "training FLOPs/token" in out
    bad = subprocess.run(
        [sys.executable, "-m", "gpn_scale", "info", "gpn_m_130"], capture_output=True, text=True
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "did you mean 'gpn_m_130m'" in bad.stderr


def test_info_on_a_training_config_shows_its_model(tmp_path, capsys):
    """`info <a training YAML>` used to say `model.model: unknown key`: it now says what the
    file is and describes the model it trains (overrides applied); every other model loader
    refuses it in one line saying the same."""
    from gpn_scale.cli import main
    from gpn_scale.core.config import ConfigError
    from gpn_scale.models.registry import load_model_config as load_any

    run = tmp_path / "run.yaml"
    run.write_text("model: tiny\nmodel_overrides:\n  d_ffn: 256\noptim:\n  lr: 1.0e-3\n")
    assert main(["info", str(run)]) == 0
    out, err = capsys.readouterr()
    assert f"{run} is a training config; showing its model, tiny, with model_overrides" in err
    assert "f=256" in out and "model.model" not in out + err
    assert main(["info", "ci_tiny"]) == 0  # a shipped training config by name
    assert "ci_tiny is a training config; showing its model, tiny" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"this is a training config \(model: tiny\), not a"):
        load_any(run)


@pytest.mark.parametrize("family", ["tiny", "transformer_pp_tiny", "gated_deltanet_tiny"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_non_finite_or_negative_model_floats_are_refused(family, bad):
    from gpn_scale.core.config import ConfigError
    from gpn_scale.models.registry import load_model_config as load_any

    with pytest.raises(ConfigError) as err:
        load_any(family, {"norm_eps": bad})
    msg = str(err.value)
    if bad < 0:  # a family's own check may come first
        assert "norm_eps" in msg and "\n" not in msg
    else:
        assert msg == f"model.norm_eps: must be a finite number >= 0, got {bad}"
    with pytest.raises(ConfigError, match=r"norm_eps: expected a (positive )?number, got 'nan'"):
        load_any(family, {"norm_eps": "nan"})  # what a dotlist's `norm_eps=nan` gives


def test_gpns_loader_is_the_registrys_and_refuses_another_family():
    """One model-config loader (models/registry.py); GPN's own, for the GPN-only tools, is it
    plus a family check, and loading a config imports no torch (the CLI's --help path)."""
    import subprocess
    import sys

    from gpn_scale.core.config import ConfigError
    from gpn_scale.models.gpn.config import load_model_config as load_gpn
    from gpn_scale.models.registry import load_model_config

    assert load_gpn("small", {"n_layers": 2}) == load_model_config("small", {"n_layers": 2})[1]
    with pytest.raises(ConfigError, match=r"^model.family: 'transformer_pp' is not GPN; "):
        load_gpn("transformer_pp_tiny")
    code = (
        "import sys; from gpn_scale.models.gpn import load_model_config; "
        "load_model_config('gpn_m_130m'); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
