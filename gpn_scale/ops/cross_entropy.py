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

import torch
from torch import Tensor

from gpn_scale.ops.backends import ANY_DEVICE, OpBackend, OpRegistry, import_error
from gpn_scale.ops.execution import current
from gpn_scale.ops.launch import is_dry, launch, nbytes

ENV_VAR = "GPN_SCALE_CROSS_ENTROPY"


class CrossEntropyBackendError(RuntimeError):
    """A cross-entropy backend was asked for that cannot serve these logits."""


def _triton_unavailable() -> str | None:
    return import_error("triton")


BACKENDS = OpRegistry("cross entropy", ENV_VAR, ENV_VAR, CrossEntropyBackendError)
BACKENDS.register(OpBackend("torch", (ANY_DEVICE,), 0, description="PyTorch ops: the reference"))
BACKENDS.register(
    OpBackend("triton", ("cuda",), 10, _triton_unavailable, description="one fused kernel")
)


def use_triton(logits: Tensor) -> bool:
    """The kernel serves float32/bf16/fp16 logits on CUDA (on meta tensors only while the
    launch accounting runs dry; on any device with `execution(triton_anywhere=True)`);
    float64 and CPU keep the PyTorch form. GPN_SCALE_CROSS_ENTROPY=torch keeps it everywhere
    (bisecting)."""
    if logits.dtype == torch.float64:
        return False
    choice = BACKENDS.requested()
    if choice == "torch":
        return False
    device = logits.device.type
    if current().triton_anywhere or (device == "meta" and is_dry()):
        return _triton_unavailable() is None
    if choice == "triton":
        why = _triton_unavailable() or (
            None if device == "cuda" else f"the kernel serves CUDA tensors, not {device}"
        )
        if why is not None:
            raise CrossEntropyBackendError(
                f"{ENV_VAR}=triton cannot run here ({why}); unset it or set it to torch"
            )
        return True
    return BACKENDS.auto(device).name == "triton"


def softmax_xent_(
    logits: Tensor, targets: Tensor, need_grad: bool, phase: str = "decode"
) -> Tensor:
    """Per row: logsumexp(logits) - logits[target] (float32, (rows,)); with `need_grad`,
    `logits` is overwritten with softmax(logits) - onehot(target) in its own dtype."""
    from gpn_scale.ops import cross_entropy_kernels as k

    rows, V = logits.shape
    assert logits.stride(1) == 1
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    block = 16 if logits.device.type == "cpu" else min(4096, 1 << (V - 1).bit_length())
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
    )
    return loss
