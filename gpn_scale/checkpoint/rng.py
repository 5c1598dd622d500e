"""RNG state capture/restore in a form that torch.load(weights_only=True) accepts.

numpy's state tuple holds an ndarray (not on the weights_only allow-list), so it is stored as a
tensor plus plain python values.

CUDA: only the current device's generator is saved (one process drives one GPU). Saving
every visible GPU's (get_rng_state_all) made a resume with fewer visible GPUs per process
fail with IndexError; checkpoints written that way (a list) are still read.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """python, numpy, torch CPU and (when available) CUDA RNG states of this process."""
    algo, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "algo": str(algo),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of capture_rng_state (CUDA only when both the state and the device have it)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state(
        (n["algo"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda, device = state["cuda"], torch.cuda.current_device()
        if isinstance(cuda, (list, tuple)):  # older checkpoints: every visible GPU's state
            cuda = cuda[device] if device < len(cuda) else cuda[0]
        torch.cuda.set_rng_state(cuda, device)
