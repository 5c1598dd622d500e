"""The one execution-settings object (gpn_scale/ops/execution.py): nested blocks add to the
outer one's, and every exit restores what was there, an error's included."""

from __future__ import annotations

import threading

import pytest
import torch

from gpn_scale.ops import launch
from gpn_scale.ops.execution import Execution, current, execution


def test_nested_blocks_add_and_exits_restore():
    assert current() == Execution()
    with execution(matmul_dtype=torch.bfloat16):
        with execution(assumed_sms=132) as inner:
            assert (inner.matmul_dtype, inner.assumed_sms) == (torch.bfloat16, 132)
        assert current().assumed_sms is None and current().matmul_dtype == torch.bfloat16
        with pytest.raises(RuntimeError), execution(dry=True):
            assert launch.is_dry()
            raise RuntimeError("inside")
        assert not launch.is_dry()
    assert current() == Execution()
    with pytest.raises(TypeError):
        with execution(no_such_setting=1):
            pass


def test_other_threads_see_the_settings():
    """Autograd runs CUDA backwards on its own threads: they must see what the caller set
    (a ContextVar would not carry over)."""
    seen = []
    with execution(triton_anywhere=True):
        worker = threading.Thread(target=lambda: seen.append(current().triton_anywhere))
        worker.start()
        worker.join()
    assert seen == [True]
