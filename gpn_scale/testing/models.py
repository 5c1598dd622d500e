"""Tiny configs and models with non-trivial weights: for the model tests and the device
check (`gpn_scale.bench.gpu`), which hold the engine equal to the reference path."""

from __future__ import annotations

from typing import Any

import torch

from gpn_scale.models.gpn import GPN, GPNConfig

TINY = dict(
    vocab_size=37, d_state=16, d_emb=8, d_ffn=24, n_heads=2, d_key=4, d_value=6, chunk_size=4
)


# The one table of GPN shapes the equality tests run (each test takes the names it needs: the
# engine against the reference path, every step backend against the PyTorch steps, the
# sharded engine against one process), changes to TINY.
GPN_CASES: dict[str, dict[str, Any]] = {
    "1-layer": dict(),
    "2-layer": dict(n_layers=2),
    "3-layer": dict(n_layers=3, chunk_size=5),
    "gpn-no-memory": dict(memory=False),
    "gpn-2-layer": dict(memory=False, n_layers=2),
    "decoder-bias": dict(decoder_bias=True),
    "chunk-divides-T": dict(chunk_size=4),  # T = 12 in the engine tests
    "chunk-1": dict(chunk_size=1),
    "chunk-not-dividing": dict(chunk_size=5),
    "chunk-longer-than-T": dict(chunk_size=64),
    "tbptt": dict(tbptt=5, chunk_size=4),
    "tbptt-2-layer": dict(tbptt=4, n_layers=2, chunk_size=3),
    "wide-heads": dict(n_heads=3, d_key=16, d_value=20, d_state=40, d_ffn=36),
    "loss-in-small-chunks": dict(loss_chunk_tokens=7),
}


def gpn_cases(*names: str, **changes: Any) -> dict[str, dict[str, Any]]:
    """The named GPN_CASES, each with `changes` on top (e.g. widths a tp group splits)."""
    return {name: {**GPN_CASES[name], **changes} for name in names}


def tiny_config(**changes) -> GPNConfig:
    values: dict[str, Any] = dict(TINY)
    if changes.get("memory") is False:
        values.update(n_heads=0, d_key=0, d_value=0)
    values.update(changes)
    return GPNConfig.from_dict(values)  # engine options may be named flat (chunk_size=4)


def perturbed_model(
    cfg: GPNConfig, dtype: torch.dtype = torch.float64, seed: int = 0, scale: float = 0.2
) -> GPN:
    """The reference init zeroes the gates and the FFN output; perturb every parameter so that
    every path of the model (and of its gradient) is exercised."""
    torch.manual_seed(seed)
    model = GPN(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def bf16_errors(
    backend: str, device: torch.device | str = "cpu", n_layers: int = 1
) -> tuple[float, float]:
    """How far bf16 autocast takes the loss and gradients from the float32 model: (the
    PyTorch steps' error, `backend`'s), each the largest relative L2 error over the loss and
    every gradient, on one fixed case. A step backend's bf16 path is sound when its error is
    of the steps' order (the CPU test and the device check both hold it to twice). The case
    has one layer (`n_layers`): two perturbed layers amplify bf16 rounding ~30x in either
    path."""
    cfg = tiny_config(n_layers=n_layers, chunk_size=5, cuda_graphs=False)
    tokens = torch.randint(0, cfg.vocab_size, (3, 13), generator=torch.Generator().manual_seed(3))
    tokens = tokens.to(device)

    def run(step_backend: str, bf16: bool) -> list[torch.Tensor]:
        model = perturbed_model(cfg.replace(step_backend=step_backend), torch.float32)
        model = model.to(device)
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
            out = model(tokens, return_state=True)
        if out.state.s.dtype != torch.float32 or out.state.memory.dtype != torch.float32:
            raise AssertionError("bf16 autocast: the state and memory must stay float32")
        return [out.loss, *torch.autograd.grad(out.loss, list(model.parameters()))]

    def err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
        return max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want))

    exact = run("reference", bf16=False)
    return err(run("reference", bf16=True), exact), err(run(backend, bf16=True), exact)
