"""CUDA RNG state in checkpoints: the current device's only, so a resume with fewer visible
GPUs per process works (torch.cuda replaced by a fake with N devices on this CPU machine)."""

from __future__ import annotations

import io

import pytest
import torch

from gpn_scale.checkpoint.rng import capture_rng_state, restore_rng_state


class FakeCuda:
    """The torch.cuda RNG calls, over `n` devices with distinct states."""

    def __init__(self, n: int, current: int) -> None:
        self.n, self.current = n, current
        self.states = [torch.full((16,), 10 * n + i, dtype=torch.uint8) for i in range(n)]

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.n

    def current_device(self) -> int:
        return self.current

    def _index(self, device) -> int:
        index = device if isinstance(device, int) else torch.device(device).index
        index = self.current if index is None else index
        if not 0 <= index < self.n:
            raise IndexError(f"device {index} of {self.n}")
        return index

    def get_rng_state(self, device="cuda"):
        return self.states[self._index(device)].clone()

    def get_rng_state_all(self):
        return [s.clone() for s in self.states]

    def set_rng_state(self, state, device="cuda"):
        self.states[self._index(device)] = state.clone()

    def set_rng_state_all(self, states):
        for i, state in enumerate(states):
            self.set_rng_state(state, i)


def _use(monkeypatch, fake: FakeCuda) -> None:
    for name in (
        "is_available",
        "is_initialized",
        "device_count",
        "current_device",
        "get_rng_state",
        "get_rng_state_all",
        "set_rng_state",
        "set_rng_state_all",
    ):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))


def _round_trip(state):  # as the checkpoint manager reads rank files
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_resume_with_fewer_visible_gpus(monkeypatch):
    saved_on = FakeCuda(8, current=5)
    _use(monkeypatch, saved_on)
    state = _round_trip(capture_rng_state())
    assert torch.equal(state["cuda"], saved_on.states[5])

    resumed_on = FakeCuda(1, current=0)  # e.g. CUDA_VISIBLE_DEVICES set per rank now
    _use(monkeypatch, resumed_on)
    restore_rng_state(state)
    assert torch.equal(resumed_on.states[0], saved_on.states[5])


@pytest.mark.parametrize("current", [0, 3])
def test_old_checkpoints_with_every_gpus_state_still_load(monkeypatch, current):
    saved_on = FakeCuda(2, current=0)
    _use(monkeypatch, saved_on)
    state = capture_rng_state()
    state["cuda"] = saved_on.get_rng_state_all()  # the earlier format: a list
    resumed_on = FakeCuda(4, current=current)
    before = [s.clone() for s in resumed_on.states]
    _use(monkeypatch, resumed_on)
    restore_rng_state(_round_trip(state))
    # The current device's entry where the list has one, else the first; others untouched.
    want = saved_on.states[current] if current < 2 else saved_on.states[0]
    assert torch.equal(resumed_on.states[current], want)
    assert all(
        torch.equal(a, b) for i, (a, b) in enumerate(zip(resumed_on.states, before)) if i != current
    )
