"""Every registered family through the eval stack: continuation scores from the carried (and
batch-indexed) state equal a full forward, and greedy decoding equals its argmax. A family
whose module has not landed yet is skipped by name."""

from __future__ import annotations

import pytest
import torch

from gpn_scale.eval.generate import Sampling, generate
from gpn_scale.eval.scoring import score_continuations, select_state
from gpn_scale.models.registry import family_names, get_family, load_model_config

TINY = {"gpn": "tiny"}  # other families: configs/model/<family>_tiny.yaml


def _tiny_model(name: str) -> torch.nn.Module:
    try:
        get_family(name)
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("gpn_scale.models."):
            raise  # the family is here but one of its imports is not
        pytest.skip(f"family {name} is not in this tree yet")
    spec, cfg = load_model_config(TINY.get(name, f"{name}_tiny"))
    torch.manual_seed(0)
    model = spec.build(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("name", family_names())
def test_scoring_and_decoding_from_the_state_match_the_full_forward(name: str) -> None:
    model = _tiny_model(name)
    V = model.config.vocab_size
    ctx = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    requests = [(ctx, [1, 2, 3]), (ctx, [4]), (ctx[:5], [5, 6]), ([], [7, 8])]
    scores = score_continuations(model, requests, batch_size=4)
    with torch.no_grad():
        state = model(torch.tensor([ctx, ctx, ctx]), return_state=True).state
        select_state(state, torch.tensor([2, 0]), 3)  # the family's state can be reused
        for (c, w), s in zip(requests, scores):
            logits = model(torch.tensor([c + w]), return_logits=True).logits.double()
            logp = torch.log_softmax(logits, -1)[0, len(c) :]
            want = logp.gather(-1, torch.tensor(w)[:, None])[:, 0]
            torch.testing.assert_close(s.logprobs, want, rtol=1e-9, atol=1e-9)
        prompts = [ctx, ctx[:3], ctx]
        out = generate(model, prompts, Sampling(max_new_tokens=5, temperature=0), batch_size=2)
        for p, g in zip(prompts, out):
            logits = model(torch.tensor([p + g.tokens]), return_logits=True).logits[0]
            assert logits[len(p) : len(p) + 5].argmax(-1).tolist() == g.tokens
