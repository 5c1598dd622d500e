"""The meta kernels for addmm with out_dtype (ops/meta_kernels.py): their shapes, dtypes and
refusals, the probe that decides whether they are needed, and, in a process whose torch has
the GPU image's bug (torch 2.11: the meta kernel takes out_dtype as beta), a launch
accounting equal to the one here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gpn_scale.ops import meta_kernels


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_the_result_has_the_product_shape_in_out_dtype():
    y = meta_kernels.addmm_dtype(
        _meta(6, dtype=torch.float32), _meta(4, 3), _meta(3, 6), torch.float32
    )
    assert (y.shape, y.dtype, y.device.type) == ((4, 6), torch.float32, "meta")
    y = meta_kernels.addmm_dtype(_meta(4, 6), _meta(4, 3), _meta(3, 6), torch.bfloat16)
    assert (y.shape, y.dtype) == ((4, 6), torch.bfloat16)


def test_the_out_form_writes_into_out_and_resizes_it():
    out = _meta(4, 6, dtype=torch.float32)
    got = meta_kernels.addmm_dtype_out(out, _meta(4, 3), _meta(3, 6), torch.float32, out=out)
    assert got is out and got.shape == (4, 6)
    empty = _meta(0, dtype=torch.float32)
    got = meta_kernels.addmm_dtype_out(
        _meta(6, dtype=torch.float32), _meta(4, 3), _meta(3, 6), torch.float32, out=empty
    )
    assert got is empty and got.shape == (4, 6)


@pytest.mark.parametrize(
    "self_shape, a_shape, b_shape, b_dtype, out_dtype, message",
    [
        ((4, 6), (4, 3), (2, 6), torch.bfloat16, torch.float32, "cannot be multiplied"),
        ((4, 6), (4, 3, 1), (3, 6), torch.bfloat16, torch.float32, "must be matrices"),
        ((4, 6), (4, 3), (3, 6), torch.float16, torch.float32, "one dtype"),
        ((4, 6), (4, 3), (3, 6), torch.bfloat16, torch.float64, "out_dtype must be"),
        ((5, 6), (4, 3), (3, 6), torch.bfloat16, torch.float32, "does not broadcast"),
    ],
)
def test_operands_that_cuda_would_refuse_are_refused(
    self_shape, a_shape, b_shape, b_dtype, out_dtype, message
):
    with pytest.raises(RuntimeError, match=message):
        meta_kernels.addmm_dtype(
            _meta(*self_shape, dtype=torch.float32),
            _meta(*a_shape),
            _meta(*b_shape, dtype=b_dtype),
            out_dtype,
        )


def test_an_out_of_another_dtype_is_refused():
    out = _meta(4, 6, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="out has dtype"):
        meta_kernels.addmm_dtype_out(out, _meta(4, 3), _meta(3, 6), torch.float32, out=out)


def test_the_probe_is_no_launch_of_the_step_it_first_runs_in():
    """The probe runs an addmm on meta tensors once a process: inside the accounting's
    recorder that was a 16-FLOP launch of whichever step came first (the Transformer++
    baseline's FLOPs were exact only after a GPN had been accounted)."""
    from gpn_scale.accounting.kernel_record import AtenRecorder

    meta_kernels.meta_addmm_takes_out_dtype.cache_clear()
    with AtenRecorder(sequential=True) as recorder:
        meta_kernels.meta_addmm_takes_out_dtype()
    assert recorder.ops == []


# Run in a process of its own: the Meta kernels it registers are the process's.
ACCOUNT = """
    import json, sys
    from gpn_scale.accounting import step_model
    from gpn_scale.models.gpn import load_model_config

    def accounted():
        acc = step_model.account(load_model_config("tiny"), 2, 16)
        return [(op.name, op.phase, op.bytes, op.flops) for op in acc.ops]

    if sys.argv[1:] == ["broken"]:
        import torch
        from gpn_scale.ops import meta_kernels

        def takes_out_dtype_as_beta(self, mat1, mat2, out_dtype, *, beta=1, alpha=1, **out):
            # what torch 2.11's decomposition does: out + beta * self, with beta = out_dtype
            return out_dtype * self

        library = torch.library.Library("aten", "IMPL")
        for overload in ("addmm.dtype", "addmm.dtype_out"):
            library.impl(overload, takes_out_dtype_as_beta, "Meta", allow_override=True)
        assert not meta_kernels.meta_addmm_takes_out_dtype()
    json.dump(accounted(), sys.stdout)
"""


def test_a_torch_with_the_broken_meta_kernel_accounts_every_gemm(tmp_path):
    """With torch 2.11's meta addmm.dtype (out_dtype taken as beta), the accounting's dry run
    recorded no GEMM where the CUDA path accumulates in float32 (the parallel recompute's
    addmm, ~12% of the 130M step). With the kernels registered it records the same launches,
    bytes and FLOPs as a torch whose own kernel works."""
    from gpn_scale.accounting import step_model
    from gpn_scale.models.gpn import load_model_config

    script = tmp_path / "account.py"
    script.write_text(textwrap.dedent(ACCOUNT))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, str(script), "broken"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    broken = [tuple(op) for op in json.loads(proc.stdout)]
    here = step_model.account(load_model_config("tiny"), 2, 16)
    assert any(name == "addmm" for name, *_ in broken)
    assert broken == [(op.name, op.phase, op.bytes, op.flops) for op in here.ops]
