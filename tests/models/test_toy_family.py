"""A fourth family built from docs/families.md's "Adding a family" alone: the bigram model of
its steps (config, model, counts, no tensor-parallel plan, its spec, no export adapter),
registered in the test, goes through `gpn-scale info`, train (the real trainer entry point),
resume from a checkpoint, the held-out eval and export; where it cannot go (export to Hugging
Face, GPN's run options, the state analyses) the CLI says so in one line. Nothing here
touches gpn_scale/ (the family is the page's, in this file), and the family is gone again
after each test."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpn_scale.cli import main
from gpn_scale.core.config import ConfigError, check_fields
from gpn_scale.models import registry
from gpn_scale.models.blocks import shift_in, start_tokens
from gpn_scale.models.protocol import FamilySpec, LanguageModel, LMOutput
from gpn_scale.scaling.families import model_facts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_helpers import train_args, train_losses  # noqa: E402


# ---- step 2: the config -------------------------------------------------------------------
@dataclass(frozen=True)
class BigramConfig:
    vocab_size: int
    d_model: int
    n_layers: int = 1
    init_std: float = 0.02
    name: str = ""
    family_name: ClassVar[str] = "bigram"

    @property
    def family(self) -> str:
        return self.family_name

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family_name, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> BigramConfig:
        values = {k: v for k, v in values.items() if not (k == "family" and v == cls.family_name)}
        check_fields(cls, values, f"unknown key for family {cls.family_name}")
        return cls(**values)


# ---- step 3: the model --------------------------------------------------------------------
class BigramLM(nn.Module):
    def __init__(self, config: BigramConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size + 1, config.d_model)  # + start
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        for p in self.parameters():
            nn.init.normal_(p, std=config.init_std)

    def forward(self, tokens, state=None, *, return_state=False, return_logits=False):
        if state is None:
            state = self.initial_state(tokens.shape[0], tokens.device)
        inputs, pending = shift_in(tokens, state)
        logits = self.head(self.embedding(inputs))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        return LMOutput(loss, pending if return_state else None, logits if return_logits else None)

    def initial_state(self, batch_size, device=None):
        return start_tokens(batch_size, self.config.vocab_size, device)

    def next_token_logits(self, state):
        return self.head(self.embedding(state))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ---- step 4: the counts -------------------------------------------------------------------
def count_parameters(cfg: BigramConfig) -> int:
    return (cfg.vocab_size + 1) * cfg.d_model + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: BigramConfig, seq_len: int) -> float:
    return 3 * 2 * cfg.d_model * cfg.vocab_size


# ---- step 5: no tensor-parallel plan, one FSDP unit, not compiled (the defaults) ----------
# ---- step 6: the spec ---------------------------------------------------------------------
SPEC = FamilySpec(
    name=BigramConfig.family_name,
    config_from_dict=BigramConfig.from_dict,
    build=lambda cfg: BigramLM(cfg),
    count_parameters=count_parameters,
    flops_per_token=flops_per_token,
    fsdp_units=lambda model: [],
    compat_keys=lambda cfg: {
        "family": cfg.family_name,
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
    },
    recurrent=True,  # the pending token: fixed size
    title="Bigram",
    hf_adapter=None,  # no Hugging Face architecture: --format hf is refused
)


# ---- step 7: registered (in the test, for the test only) ----------------------------------
@pytest.fixture
def bigram() -> Iterator[FamilySpec]:
    with registry.registered(SPEC) as spec:
        yield spec
    assert "bigram" not in registry.family_names()  # nothing leaks into the next test
    with pytest.raises(ConfigError, match="unknown family 'bigram'"):
        registry.get_family("bigram")


@pytest.fixture
def model_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "bigram_tiny.yaml"
    path.write_text("family: bigram\nvocab_size: 512\nd_model: 16\n")
    return path


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpn-scale: error: "), err
    return err[0].removeprefix("gpn-scale: error: ")


def test_the_spec_counts_what_the_model_holds_and_the_model_is_the_protocol(bigram, model_yaml):
    spec, cfg = registry.load_model_config(model_yaml)
    assert spec is SPEC and cfg == BigramConfig(512, 16, name="bigram_tiny")
    model = spec.build(cfg)
    assert isinstance(model, LanguageModel)
    assert spec.count_parameters(cfg) == model.num_parameters() == 16_400
    tokens = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(0))
    full = model(tokens, return_logits=True).logits
    state = model(tokens[:, :5], return_state=True).state
    torch.testing.assert_close(model.next_token_logits(state), full[:, 5])
    with pytest.raises(ConfigError, match=r"model.d_modle: unknown key for family bigram"):
        registry.load_model_config(model_yaml, {"d_modle": 8})
    # sweeps and fits: its label is its name, its depth no variant (depth_is_variant=False)
    facts = model_facts(model_yaml, 64, {"n_layers": 2})
    assert (facts.registry_name, facts.label, facts.params) == ("bigram", "bigram", 16_400)


def test_a_name_already_taken_is_refused(bigram):
    with pytest.raises(ValueError, match="'bigram' is already registered"):
        registry.register(SPEC)
    with pytest.raises(ValueError, match="'gpn' is already registered"):
        registry.register(dataclasses.replace(SPEC, name="gpn"))


def test_info_train_resume_eval_and_export(
    bigram, model_yaml, default_corpus, tmp_path, private_tmpdir, capsys
):
    from gpn_scale.eval.load import load

    assert main(["info", str(model_yaml)]) == 0
    info = capsys.readouterr().out
    assert "bigram_tiny (bigram, 1 layer(s))" in info and "16,400" in info
    assert "vocab_size=512 d_model=16" in info and "recurrent (fixed size)" in info

    # train: 4 steps of the real trainer, a checkpoint every 2 (ci_tiny)
    model = f"model={model_yaml}"
    args = train_args(default_corpus, tmp_path / "run", model, "schedule.total_steps=4")
    assert main(args) == 0
    losses = train_losses(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    ckpts = tmp_path / "run" / "checkpoints"

    # resume: from step 2, in a run folder of its own, to the same steps 3 and 4
    again = train_args(default_corpus, tmp_path / "resumed", model, "schedule.total_steps=4")
    assert main([*again, "--resume", str(ckpts / "step_000000002")]) == 0
    resumed = train_losses(tmp_path / "resumed")
    assert sorted(resumed) == [3, 4]
    assert resumed == {s: pytest.approx(losses[s], rel=1e-6) for s in (3, 4)}

    # eval: the held-out loss of the final checkpoint is the run's own
    capsys.readouterr()
    assert main(["eval", *args[1:], "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    done = json.loads((ckpts / "DONE").read_text())
    assert result["step"] == 4 and result["eval/loss"] == done["final_eval_loss"]
    assert result["eval/ppl"] == pytest.approx(math.exp(result["eval/loss"]))

    # export: safetensors, loaded back to the checkpoint's logits
    out = tmp_path / "export"
    assert main(["export", str(ckpts / "step_000000004"), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["family"] == "bigram"
    tokens = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = load(str(ckpts / "step_000000004"), device="cpu").model(tokens, return_logits=True)
        got = load(str(out), device="cpu").model(tokens, return_logits=True)
    torch.testing.assert_close(got.logits, want.logits)

    # where it cannot go, one line each (exit 2)
    capsys.readouterr()
    hf = tmp_path / "hf"
    assert main(["export", str(ckpts / "step_000000004"), "--out", str(hf), "--format", "hf"]) == 2
    assert _err_line(capsys) == (
        "--format hf: the bigram family has no Hugging Face architecture of the same network "
        "(only transformer_pp maps onto LlamaForCausalLM); export it with --format safetensors"
    )
    assert not hf.exists()
    assert main(["analyze", str(ckpts / "step_000000004"), "--out", str(tmp_path / "a")]) == 2
    assert _err_line(capsys).endswith(
        "is a bigram checkpoint; the state analyses read GPN / GPN+M's single recurrent state "
        "and memory heads (use `gpn-scale eval` for it)"
    )


@pytest.mark.parametrize(
    "option, line",
    [
        ("train.tbptt=8", "train.tbptt: truncated BPTT is a GPN option; model={m} is family "
         "bigram, which has no recurrence to truncate; remove train.tbptt"),
        ("engine.chunk_size=8", "engine.chunk_size: the engine options are GPN's; model={m} is "
         "family bigram; remove the engine section"),
        ("compile.enable=true", "compile.enable: model={m} is family bigram, which declares no "
         "blocks to compile; compile.enable is for transformer_pp, gated_deltanet; set "
         "compile.enable=false (in a sweep, set it on those families' entries only)"),
    ],
)  # fmt: skip
def test_gpns_run_options_are_refused_in_one_line(bigram, model_yaml, tmp_path, option, line):
    from gpn_scale.run.config import load_train_config
    from gpn_scale.run.model import model_config

    cfg = load_train_config("ci_tiny", [f"model={model_yaml}", option])
    with pytest.raises(ConfigError) as err:
        model_config(cfg)
    assert str(err.value) == line.format(m=model_yaml)
