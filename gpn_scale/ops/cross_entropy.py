"""Softmax cross-entropy over one block of logit rows, and its gradient, in one Triton kernel.

The decode (`gpn_scale.models.gpn.loss`) forms (rows x V) logits a block of positions at a time.
As PyTorch ops the block is then read and written ~10 times in float32 (cast, max, subtract,
exp, sum, divide, the one-hot subtract, the cast back), ~60 bytes per logit: at the 130M
model's V = 32000 the decode moved ~400 GB of a 2048-token, 64-sequence training step (the
launch accounting, docs/perf.md). The kernel reads the logits in their own dtype once for
the log-sum-exp and once more to write softmax - onehot over them in place (~8 bytes per
bf16 logit). It computes in float32 from the same rounded logits as the PyTorch form, which
stays the reference (and the path on CPU and in float64).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from gpn_scale.ops.backends import select_torch_or_triton, torch_or_triton
from gpn_scale.ops.launch import launch, nbytes

ENV_VAR = "GPN_SCALE_CROSS_ENTROPY"
# The kernel's two passes over a row software-pipelined: the next blocks' logits in flight
# while one is reduced (the gate checks they are copied asynchronously).
XENT_STAGES = 3
XENT_BLOCK = 2048  # logits a block (at most)
XENT_WARPS = 4  # (4,096-wide pipelined blocks spill at 4 warps; at 8 priced slower)

# (logits (rows, V) in the matmul dtype, targets (rows,), need_grad, acc) -> (the rows'
# summed loss in acc, softmax - onehot in the logits' dtype or None). Either form may
# overwrite `logits`: the caller's block is scratch.
SoftmaxXent = Callable[[Tensor, Tensor, bool, torch.dtype], tuple[Tensor, Tensor | None]]


class CrossEntropyBackendError(RuntimeError):
    """A cross-entropy backend was asked for that cannot serve these logits."""


def torch_softmax_xent(
    logits: Tensor, targets: Tensor, need_grad: bool, acc: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """The PyTorch form, the reference: softmax and sums in `acc`, one block reused in place
    for logits, exp and the gradient."""
    mm = logits.dtype
    logits = logits.to(acc)
    picked = logits.gather(1, targets[:, None])
    top = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(top).exp_()
    denom = probs.sum(dim=-1, keepdim=True)
    total = (top + denom.log() - picked).sum()
    if not need_grad:
        return total, None
    grad = probs.div_(denom)  # softmax - onehot
    grad[torch.arange(grad.shape[0], device=grad.device), targets] -= 1.0
    return total, grad.to(mm)


def triton_softmax_xent(
    logits: Tensor, targets: Tensor, need_grad: bool, acc: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    """The kernel: float32 sums from the same rounded logits; the gradient over `logits`."""
    total = softmax_xent_(logits, targets, need_grad).sum()
    return total, (logits if need_grad else None)


BACKENDS = torch_or_triton(
    "cross entropy",
    ENV_VAR,
    CrossEntropyBackendError,
    torch_softmax_xent,
    triton_softmax_xent,
    "one fused kernel",
)


def select(logits: Tensor) -> SoftmaxXent:
    """The form for a block of `logits` (`backends.select_torch_or_triton`): the kernel on
    CUDA (float32/bf16/fp16), the PyTorch form on CPU and in float64 (the kernel computes
    in float32). GPN_SCALE_CROSS_ENTROPY=torch keeps the PyTorch form everywhere."""
    return select_torch_or_triton(BACKENDS, logits, torch_softmax_xent)


def use_triton(logits: Tensor) -> bool:
    """Whether the kernel serves this block (`select`'s choice, for reports and tests)."""
    return select(logits) is triton_softmax_xent


def softmax_xent_(
    logits: Tensor, targets: Tensor, need_grad: bool, phase: str = "decode"
) -> Tensor:
    """Per row: logsumexp(logits) - logits[target] (float32, (rows,)); with `need_grad`,
    `logits` is overwritten with softmax(logits) - onehot(target) in its own dtype."""
    from gpn_scale.ops import cross_entropy_kernels as k

    rows, V = logits.shape
    assert logits.stride(1) == 1
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    block = 16 if logits.device.type == "cpu" else min(XENT_BLOCK, 1 << (V - 1).bit_length())
    moved = nbytes(logits) * (3 if need_grad else 1) + nbytes(targets, loss)
    launch(
        k.softmax_xent_kernel,
        (rows,),
        "softmax cross-entropy",
        phase,
        moved,
        5 * rows * V,
        logits,
        logits.stride(0),
        targets,
        loss,
        V,
        NEED_GRAD=need_grad,
        BLOCK_V=block,
        STAGES=XENT_STAGES,
        num_warps=1 if logits.device.type == "cpu" else XENT_WARPS,
    )
    return loss
