"""The tiny training loop the Gated DeltaNet FSDP2 test runs in one process and on 2 ranks."""

from __future__ import annotations

from typing import Any

import torch

from gpn_scale.models.registry import load_model_config

STEPS = 3
BATCH, SEQ = 4, 24


def make_model() -> tuple[Any, torch.nn.Module]:
    spec, cfg = load_model_config("gated_deltanet_tiny", {"chunk_size": 8})
    torch.manual_seed(0)
    # float64: Adam divides by sqrt(v), so a float32 reduction-order difference in a near-zero
    # gradient can flip an update's sign; in float64 the two runs agree to ~1e-12.
    return spec, spec.build(cfg).double()


def make_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def train_steps(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[float]:
    """AdamW steps over consecutive windows, the state carried (detached) from one to the next."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    state, losses = None, []
    for tokens in batches:
        out = model(tokens, state, return_state=True)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        state = out.state.detach()
        losses.append(out.loss.item())
    return losses
