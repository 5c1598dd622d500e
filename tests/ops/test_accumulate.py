"""The losses' acc += a @ b with a wider accumulator (functional.add_product_): the PyTorch
form on CPU, one addmm with out_dtype on the CUDA path (run here on meta tensors, as the
launch accounting runs it)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpn_scale.ops.gpn_step import functional


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(f"{func.overloadpacket.__name__}.{func._overloadname}")
        return func(*args, **(kwargs or {}))


def _operands(device: str):
    g = torch.Generator().manual_seed(0)
    acc = torch.randn(6, 5, generator=g).to(device)
    a = torch.randn(6, 7, generator=g).to(torch.bfloat16).to(device)
    b = torch.randn(7, 5, generator=g).to(torch.bfloat16).to(device)
    return acc, a, b


def test_cpu_adds_the_product_formed_in_the_operands_dtype():
    acc, a, b = _operands("cpu")
    want = acc + (a @ b).float()
    functional.add_product_(acc, a, b)
    assert torch.equal(acc, want)


def test_equal_dtypes_add_the_product():
    acc = torch.zeros(3, 2, dtype=torch.float64)
    functional.add_product_(acc, torch.ones(3, 4, dtype=torch.float64), torch.ones(4, 2).double())
    assert torch.equal(acc, torch.full((3, 2), 4.0, dtype=torch.float64))


def test_the_cuda_path_is_one_gemm_into_the_accumulator():
    acc, a, b = _operands("meta")
    with _Ops() as seen:
        functional.add_product_(acc, a, b)
    assert seen.names == ["addmm.dtype_out"]
    assert acc.dtype == torch.float32 and acc.shape == (6, 5)
