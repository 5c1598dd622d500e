"""The op-backend registry (gpn_scale/ops/backends.py): names and aliases, the environment
override, `auto` by device and priority with the probes, and the ops registered in it.
That each backend computes what its op's reference does is the op's own test, run over these
registries (tests/ops/test_gpn_step.py, tests/models/test_gated_deltanet.py,
tests/ops/test_cross_entropy.py)."""

from __future__ import annotations

import pytest

from gpn_scale.ops import backends, cross_entropy
from gpn_scale.ops import gated_delta_rule as gdr
from gpn_scale.ops.backends import ANY_DEVICE, OpBackend, OpRegistry, Request
from gpn_scale.ops.execution import execution
from gpn_scale.ops.gpn_step import fused
from gpn_scale.ops.gpn_step import registry as gpn_step


class Refused(RuntimeError):
    pass


def _registry(fast_works: bool = True) -> OpRegistry:
    reg = OpRegistry("toy", "TOY_BACKEND", "model.toy", Refused)
    reg.register(OpBackend("slow", (ANY_DEVICE,), 0, aliases=("spec",)))
    reg.register(
        OpBackend("fast", ("cuda",), 10, lambda: None if fast_works else "no compiler here")
    )
    return reg


def test_auto_prefers_the_devices_best_backend_and_falls_back_when_its_probe_fails():
    reg = _registry()
    assert reg.choices == ("auto", "slow", "fast")
    assert [b.name for b in reg.available("cuda")] == ["fast", "slow"]
    assert [b.name for b in reg.available("cpu")] == ["slow"]
    assert reg.auto("cuda").name == reg.preferred("cuda").name == "fast"
    broken = _registry(fast_works=False)
    assert broken.preferred("cuda").name == "fast"  # what the op warns it could not use
    assert broken.auto("cuda").name == "slow"
    assert [b.name for b in broken.available("cuda")] == ["slow"]


def test_names_aliases_and_the_environment_override(monkeypatch):
    reg = _registry()
    monkeypatch.delenv("TOY_BACKEND", raising=False)
    assert reg.requested("SPEC") == "slow"
    assert reg.requested() == "auto"
    monkeypatch.setenv("TOY_BACKEND", " fast ")
    assert reg.requested("slow") == "fast"  # the environment wins over the config
    monkeypatch.setenv("TOY_BACKEND", "quick")
    with pytest.raises(Refused, match=r"^TOY_BACKEND='quick': expected one of auto, slow, fast"):
        reg.requested()
    monkeypatch.delenv("TOY_BACKEND")
    with pytest.raises(Refused, match=r"^model.toy='x': .*\(aliases: spec=slow\) \(toy backend\)$"):
        reg.requested("x")


def _dispatching(fast_works: bool = True, interpreter: bool = False) -> OpRegistry:
    reg = OpRegistry("toy", "TOY_BACKEND", "model.toy", Refused)
    reg.register(
        OpBackend("slow", (ANY_DEVICE,), 0, build=lambda r: ("slow", r), description="the spec")
    )
    reg.register(
        OpBackend(
            "host",
            ("cpu",),
            20,
            build=lambda r: ("host", r),
            splits_tp=False,
            tp_refusal="its loops do not split",
        )
    )
    reg.register(
        OpBackend(
            "fast",
            ("cuda",),
            10,
            lambda: None if fast_works else "no compiler here; install one",
            build=lambda r: ("fast", r),
            also_serves=lambda device: interpreter,
            wrong_device_hint="set INTERPRET=1",
        )
    )
    return reg


def test_select_builds_what_the_one_rule_picks_for_device_and_tp(monkeypatch):
    monkeypatch.delenv("TOY_BACKEND", raising=False)
    reg = _dispatching()
    assert reg.select("auto", "cpu") == ("host", Request("cpu", 1))
    assert reg.select("auto", "cpu", tp_size=2) == ("slow", Request("cpu", 2))  # host can't split
    assert reg.select("auto", "cuda", tp_size=4) == ("fast", Request("cuda", 4))
    assert reg.select("auto", "meta") == ("slow", Request("meta", 1))
    assert reg.select("slow", "cuda")[0] == "slow"
    monkeypatch.setenv("TOY_BACKEND", "slow")  # the override over the config's choice
    assert reg.select("fast", "cuda")[0] == "slow"


def test_a_backend_asked_for_that_cannot_serve_is_one_line_naming_the_source_and_the_fix(
    monkeypatch,
):
    monkeypatch.delenv("TOY_BACKEND", raising=False)
    reg = _dispatching(fast_works=False)
    with pytest.raises(Refused) as info:
        reg.select("host", "cuda")
    assert str(info.value) == (
        "model.toy='host': toy backend 'host' serves CPU tensors, not cuda; use auto or slow"
    )
    with pytest.raises(Refused, match=r"^model.toy='fast': .* not cpu; set INTERPRET=1, or use "):
        reg.select("fast", "cpu")
    with pytest.raises(Refused) as info:
        reg.select("host", "cpu", tp_size=2)
    assert str(info.value) == (
        "model.toy='host': toy backend 'host' does not run under tensor parallelism (tp=2): "
        "its loops do not split; use auto or slow"
    )
    monkeypatch.setenv("TOY_BACKEND", "fast")
    with pytest.raises(Refused) as info:
        reg.select("auto", "cuda")
    assert str(info.value) == (
        "TOY_BACKEND='fast': toy backend 'fast' cannot run here (no compiler here; install one)"
    )
    assert _dispatching(interpreter=True).select("fast", "cpu")[0] == "fast"


def test_auto_falls_back_with_one_warning_naming_why(monkeypatch):
    monkeypatch.delenv("TOY_BACKEND", raising=False)
    backends.warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match=r"^no compiler here; install one \(using the spec: "):
        assert _dispatching(fast_works=False).select("auto", "cuda")[0] == "slow"


def test_a_name_is_registered_once():
    reg = _registry()
    with pytest.raises(ValueError, match="'spec' is registered twice"):
        reg.register(OpBackend("spec", (ANY_DEVICE,)))
    with pytest.raises(ValueError, match="'auto' is registered twice"):
        reg.register(OpBackend("auto", (ANY_DEVICE,)))


def test_the_ops_and_what_auto_picks_on_each_device():
    """What the tests run over on this machine: the fused CPU kernels build here (a CI
    machine without g++ would silently test only the PyTorch steps, so that is a failure)."""
    assert [b.name for b in gpn_step.BACKENDS.available("cpu")] == ["cpu", "reference"]
    assert gpn_step.BACKENDS.preferred("cuda").name == "cuda"
    assert gpn_step.BACKENDS.preferred("meta").name == "reference"
    assert [b.name for b in gdr.BACKENDS.available("cpu")] == ["chunk", "recurrent"]
    assert gdr.BACKENDS.preferred("cuda").name == "fla"
    assert [b.name for b in cross_entropy.BACKENDS.available("cpu")] == ["torch"]
    assert cross_entropy.BACKENDS.preferred("cuda").name == "triton"
    assert [b.name for b in fused.BACKENDS.available("cpu")] == ["torch"]
    assert fused.BACKENDS.preferred("cuda").name == "triton"


def test_the_cross_entropy_override(monkeypatch):
    import torch

    logits = torch.zeros(2, 3)
    monkeypatch.setenv(cross_entropy.ENV_VAR, "torch")
    with execution(triton_anywhere=True):
        assert not cross_entropy.use_triton(logits)
    monkeypatch.setenv(cross_entropy.ENV_VAR, "triton")
    with pytest.raises(
        cross_entropy.CrossEntropyBackendError,
        match=(
            r"^GPN_SCALE_CROSS_ENTROPY='triton': cross entropy backend 'triton' serves CUDA "
            r"tensors, not cpu; use auto or torch$"
        ),
    ):
        cross_entropy.use_triton(logits)
    monkeypatch.setenv(cross_entropy.ENV_VAR, "fused")
    with pytest.raises(cross_entropy.CrossEntropyBackendError, match="expected one of auto"):
        cross_entropy.use_triton(logits)
