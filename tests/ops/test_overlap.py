"""The overlapped backward and decode (gpn_scale/ops/gpn_step/overlap.py): the chunk-wide work
moved beside the reverse sweep, and each chunk's decode moved beside the next chunk's forward
steps, compute bit-for-bit what the plain order does.

On CPU the side work runs `Deferred`, as late as the main stream's waits allow: a buffer the
sweep reused before the side work read it, or a weight gradient added in another order,
shows here as a gradient that differs in its last bit."""

from __future__ import annotations

import pytest
import torch

from gpn_scale.ops.execution import execution
from gpn_scale.ops.gpn_step import overlap
from gpn_scale.testing.models import gpn_cases, perturbed_model, tiny_config

CASES = gpn_cases("1-layer", "2-layer", "gpn-no-memory", "chunk-not-dividing", "tbptt")


def _grads(cfg, dtype):
    model = perturbed_model(cfg, dtype)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (3, 17), generator=g)
    out = model(tokens, return_state=True)
    return [out.loss, *out.state, *torch.autograd.grad(out.loss, list(model.parameters()))]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_deferred_side_work_is_bit_identical(case, backend):
    cfg = tiny_config(**CASES[case]).replace(step_backend=backend, chunk_size=4)
    want = _grads(cfg, torch.float32)
    with execution(side_work=overlap.DEFERRED):
        got = _grads(cfg, torch.float32)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if b is not None:
            assert torch.equal(a, b)


def test_deferred_runs_in_submission_order_when_waited_for():
    side = overlap.Deferred()
    ran: list[int] = []
    first = side.submit(lambda: ran.append(1) or 1)
    second = side.submit(lambda: ran.append(2) or 2)
    assert ran == []
    assert side.get(second) == 2 and ran == [1, 2] and side.get(first) == 1
    side.submit(lambda: ran.append(3))
    side.join()
    assert ran == [1, 2, 3]


def test_inline_runs_when_submitted_and_cuda_only_on_cuda():
    side = overlap.side_work(torch.device("cpu"), overlap=True)
    assert isinstance(side, overlap.Inline) and not isinstance(side, overlap.Deferred)
    assert side.get(side.submit(lambda: 7)) == 7
    assert isinstance(overlap.side_work(torch.device("meta"), overlap=True), overlap.Inline)


def test_overlap_option_is_checked():
    from gpn_scale.core.config import ConfigError

    for name in ("overlap_backward", "overlap_decode"):
        with pytest.raises(ConfigError, match=f"{name}: expected true or false"):
            tiny_config(**{name: "yes"})


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_deferred_decode_pieces_are_bit_identical(backend):
    """`engine.overlap_decode`: the loss fed in several pieces (one per chunk here) gives the
    same bits when each piece runs as late as possible as when it runs at once."""
    cfg = tiny_config().replace(step_backend=backend, chunk_size=4, loss_chunk_tokens=8)
    want = _grads(cfg, torch.float32)
    with execution(side_work=overlap.DEFERRED):
        got = _grads(cfg, torch.float32)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
