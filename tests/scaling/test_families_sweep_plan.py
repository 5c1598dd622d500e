"""The shipped families sweeps plan every family with its own config class and counts.

Needs the Transformer++ and Gated DeltaNet families (their configs transformer_pp_* and
gated_deltanet_*), which the families sweeps name.
"""

from __future__ import annotations

import re
import textwrap

import pytest

from gpn_scale.cli import main
from gpn_scale.core.config import ConfigError
from gpn_scale.models.registry import load_model_config
from gpn_scale.scaling.sweep import expand_sweep, load_sweep, validate_with_trainer

LABELS = {
    "gpn+m": "gpn",
    "gpn+m-2l": "gpn",
    "gpn": "gpn",
    "transformer_pp": "transformer_pp",
    "gated_deltanet": "gated_deltanet",
}


@pytest.mark.parametrize(
    ("name", "sizes", "seeds"), [("families_ladder", 7, 3), ("families_smoke", 3, 1)]
)
def test_families_sweeps_plan_every_family(name, sizes, seeds, capsys):
    sweep = load_sweep(name, price=False)
    validate_with_trainer(sweep)
    assert {r.family: r.registry_family for r in sweep.runs} == LABELS
    for label in LABELS:
        runs = [r for r in sweep.runs if r.family == label]
        assert len({r.size for r in runs}) == sizes and len(runs) == sizes * seeds
    for r in sweep.runs:  # the plan's counts are the family's own (its FamilySpec)
        spec, cfg = load_model_config(r.model, dict(r.model_overrides))
        assert spec.name == r.registry_family
        assert r.params == spec.count_parameters(cfg)
        assert r.flops == pytest.approx(spec.flops_per_token(cfg, r.seq_len) * r.tokens)
    if name == "families_ladder":
        # the ladders match GPN+M's parameter counts within 3%, and within 5% at 130M (the
        # paper's Transformer++ +3.8%; GDN at f=1536 +2.2%, the paper's f=2048 +11.3% aside)
        by = {(r.family, re.search(r"_(\d+[mb])(_2l)?$", r.size)[1]): r.params for r in sweep.runs}
        for (label, size), n in by.items():
            tol = 0.05 if size == "130m" else 0.03
            assert abs(n / by[("gpn+m", size)] - 1) < tol, (label, size)
    assert main(["sweep", "plan", name]) == 0
    out = capsys.readouterr().out
    for label, registry in LABELS.items():
        assert any(line.split()[:3] == [label, registry, str(sizes)] for line in out.splitlines())


def test_a_mixed_sweep_validates_each_model_with_its_own_config_class(tmp_path):
    def sweep(models):
        path = tmp_path / "mixed.yaml"
        path.write_text(
            textwrap.dedent(f"""\
            name: mix
            seeds: 3
            data: {{remote: default, seq_len: 64}}
            checkpoint_root: {tmp_path / "ck"}
            wandb: {{project: p}}
            hardware: {{gpu: cpu, peak_tflops: 0.1, mfu: 0.2}}
            defaults: {{tokens: 4096, global_batch_size: 4, lr: 1.0e-3, warmup_steps: 2}}
            models:
            """)
            + "".join(f"  - {m}\n" for m in models)
        )
        return path

    ok = ["{config: tiny}", "{config: transformer_pp_tiny}", "{config: gated_deltanet_tiny}"]
    assert [r.family for r in expand_sweep(sweep(ok))] == (
        ["gpn+m"] * 3 + ["transformer_pp"] * 3 + ["gated_deltanet"] * 3
    )
    # a GPN field on a Transformer++ config: its own class rejects it, naming entry and runs
    bad = ok + ["{config: transformer_pp_tiny, name: tpp-bad, model_overrides: {d_state: 64}}"]
    with pytest.raises(ConfigError) as err:
        expand_sweep(sweep(bad))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("models[3].model_overrides: transformer_pp_tiny: ")
    assert "d_state" in msg and msg.endswith("(runs mix-tpp-bad-s*)")
    # GPN's launch accounting does not price other families
    predicted = (
        sweep(ok)
        .read_text()
        .replace("mfu: 0.2", "mfu: predicted")
        .replace("gpu: cpu", "gpu: H100-SXM")
    )
    (tmp_path / "pred.yaml").write_text(predicted)
    with pytest.raises(
        ConfigError,
        match=r"hardware.mfu: 'predicted' is GPN's launch accounting only, but models\[1\]",
    ):
        expand_sweep(tmp_path / "pred.yaml")


def test_compile_enable_is_set_per_entry_and_refused_for_gpn_at_plan_time(tmp_path):
    """compile.enable (torch.compile of the baselines' blocks) is refused by GPN: a mixed
    sweep sets it on the baselines' entries, and `sweep plan` names a GPN run given it."""

    def sweep(defaults_overrides: str, models: list[str]):
        path = tmp_path / "mixed.yaml"
        path.write_text(
            textwrap.dedent(f"""\
            name: mix
            seeds: 3
            data: {{remote: default, seq_len: 64}}
            checkpoint_root: {tmp_path / "ck"}
            wandb: {{project: p}}
            hardware: {{gpu: cpu, peak_tflops: 0.1, mfu: 0.2}}
            defaults: {{tokens: 4096, global_batch_size: 4, lr: 1.0e-3, warmup_steps: 2,
                        overrides: {defaults_overrides}}}
            models:
            """)
            + "".join(f"  - {m}\n" for m in models)
        )
        return load_sweep(path, price=False)

    on = "overrides: [compile.enable=true]"
    per_entry = sweep(
        "[]",
        [
            "{config: tiny}",
            f"{{config: transformer_pp_tiny, {on}}}",
            f"{{config: gated_deltanet_tiny, {on}}}",
        ],
    )
    validate_with_trainer(per_entry)
    compiled = {
        r.registry_family for r in per_entry.runs if "compile.enable=true" in r.train_overrides()
    }
    assert compiled == {"transformer_pp", "gated_deltanet"}
    for_all = sweep("[compile.enable=true]", ["{config: transformer_pp_tiny}", "{config: tiny}"])
    with pytest.raises(ConfigError) as err:
        validate_with_trainer(for_all)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("run 'mix-tiny-s0': the trainer rejects its config: ")
    assert "family gpn" in msg and "compile.enable is for transformer_pp, gated_deltanet" in msg
