"""GPN and GPN+M: parameters, reference initialisation and the training/eval forward.

The equations are those of `shared/spec/gpn-model.md`. This module holds the parameters in
ordinary submodules (`modules.py`; nn.Linear stores (out, in)); the sequence computation
itself lives in `engine.py` (fast, chunked) and `reference.py` (step by step, tests only).

The model knows nothing about parallelism. Its forward reads the parameters of its
submodules directly (it never calls their forward), so a sharding wrapper must treat the
whole model as one unit (FSDP2: `fully_shard` on the root).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import Tensor, nn

from gpn_scale.models.gpn.config import GPNConfig
from gpn_scale.models.gpn.modules import Gate, MemoryWrite, PredictorLayer, lecun_normal_
from gpn_scale.models.gpn.state import GPNOutput, GPNState

__all__ = [
    "GPN",
    "GPNOutput",
    "GPNState",
]  # the carry types live in state.py (engine.py uses them too)


class GPN(nn.Module):
    """GPN+M (memory=True) or GPN. `forward(tokens)` returns the mean next-token CE."""

    def __init__(self, cfg: GPNConfig) -> None:
        super().__init__()
        self.config = cfg
        d, e = cfg.d_state, cfg.d_emb
        self.embedding = nn.Embedding(cfg.vocab_size, e)
        self.fuse_norm_weight = nn.Parameter(torch.ones(e))
        self.fuse = nn.Linear(e, d, bias=False)
        self.fuse_gate = Gate(d)
        self.decode_norm_weight = nn.Parameter(torch.ones(d))
        self.decode = nn.Linear(d, e, bias=cfg.decoder_bias)
        self.write = MemoryWrite(d, cfg.n_heads, cfg.d_key, cfg.d_value) if cfg.memory else None
        self.layers = nn.ModuleList(PredictorLayer(cfg) for _ in range(cfg.n_layers))
        self.reset_parameters()

    @property
    def predictor_layers(self) -> Iterable[PredictorLayer]:
        """`layers` (the same nn.ModuleList, no copy) typed as what it holds: the type checker
        sees a ModuleList yield plain Modules, whose submodules are `Tensor | Module`."""
        return cast("Iterable[PredictorLayer]", self.layers)

    def reset_parameters(self) -> None:
        """The reference initialisation (spec table), in a fixed module order."""
        nn.init.normal_(self.embedding.weight, mean=0.0, std=0.02)
        nn.init.ones_(self.fuse_norm_weight)
        lecun_normal_(self.fuse.weight)
        self.fuse_gate.reset_parameters()
        nn.init.ones_(self.decode_norm_weight)
        lecun_normal_(self.decode.weight)
        if self.decode.bias is not None:
            nn.init.zeros_(self.decode.bias)
        if self.write is not None:
            self.write.reset_parameters()
        for layer in self.predictor_layers:
            layer.ffn.reset_parameters()
            layer.gate.reset_parameters()
            if layer.read is not None:
                layer.read.reset_parameters()

    # ------------------------------------------------------------------ state
    def state_dtype(self) -> torch.dtype:
        """The carry is float32 (float64 when the model is float64), never bf16/fp16."""
        dtype = self.fuse.weight.dtype
        return dtype if dtype in (torch.float32, torch.float64) else torch.float32

    def initial_state(self, batch_size: int, device: torch.device | str | None = None) -> GPNState:
        cfg = self.config
        device = device if device is not None else self.fuse.weight.device
        dtype = self.state_dtype()
        zeros = torch.zeros(batch_size, cfg.d_state, device=device, dtype=dtype)
        memory = (
            torch.zeros(batch_size, cfg.n_heads, cfg.d_key, cfg.d_value, device=device, dtype=dtype)
            if cfg.memory
            else None
        )
        return GPNState(zeros, zeros.clone(), memory)

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        tokens: Tensor,
        state: GPNState | None = None,
        *,
        return_state: bool = False,
        return_logits: bool = False,
    ) -> GPNOutput:
        """Mean CE over all B*T positions; x_t is predicted from the state before it.

        `state` seeds the carry (stateful windows); `return_state` returns the final carry
        (differentiable; detach it before the next window unless you backprop across).
        Under torch.autocast the large matmuls run in the autocast dtype, the state and
        memory stay in float32.
        """
        from gpn_scale.models.gpn.engine import run_engine

        return run_engine(
            self, tokens, state, return_state=return_state, return_logits=return_logits
        )

    def next_token_logits(self, state: GPNState) -> Tensor:
        """(B, V) logits of the token after the context carried by `state`.

        Position 0's logits of a one-token forward are computed from the carry before that
        token is seen, so any token serves; one step, the context is never recomputed.
        """
        B = state.s.shape[0]
        probe = torch.zeros(B, 1, dtype=torch.long, device=state.s.device)
        logits = self.forward(probe, state, return_logits=True).logits
        assert logits is not None
        return logits[:, 0]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
