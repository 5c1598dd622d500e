"""The engine's backward buffers kept from chunk to chunk and call to call: two sets per
device, alternating by chunk, each holding one chunk's recomputed activations (`ChunkActs.
BOUND`) and the sweep's adjoints (`SweepAdjoints.BOUND`). The reverse CUDA graphs bind them
by address (graphs.py), so a replay copies none of them; and fresh allocations of this size
would come straight from mmap, first-touching their pages every chunk."""

from __future__ import annotations

import math

import torch
from torch import Tensor


class Workspace:
    """One set of a chunk's backward buffers (its recomputed activations and the sweep's
    adjoints), reused from chunk to chunk and call to call (`workspaces`). Fresh allocations
    of this size come straight from mmap, and first-touching their pages cost ~15 us per
    step at SMALL (measured): the sweep writes ~7 MB of adjoints per chunk; and the CUDA
    graphs bind the buffers by address."""

    def __init__(self, max_chunk: int, device: torch.device) -> None:
        self.max_chunk = max_chunk
        self.device = device
        self._buffers: dict[str, Tensor] = {}

    def compact(
        self, name: str, shape: tuple[int, ...], chunk_dim: int | None, dtype: torch.dtype
    ) -> Tensor:
        """A contiguous (possibly uninitialised) tensor of `shape` at the start of a flat
        buffer sized for the longest chunk (`chunk_dim`: the dim that is the chunk's length;
        None: none is), so a chunk of any length finds it at the same address."""
        numel = math.prod(shape)
        full = numel if chunk_dim is None else numel // shape[chunk_dim] * self.max_chunk
        return self._buffer(name, [full], dtype)[:numel].view(shape)

    def take(
        self,
        name: str,
        shape: tuple[int, ...],
        chunk_dim: int,
        dtype: torch.dtype,
        zero: bool = False,
    ) -> Tensor:
        """A (possibly uninitialised) tensor of `shape`, whose dim `chunk_dim` is the chunk's
        length, viewed out of a buffer sized for the longest chunk."""
        full = list(shape)
        full[chunk_dim] = self.max_chunk
        view = self._buffer(name, full, dtype).narrow(chunk_dim, 0, shape[chunk_dim])
        return view.zero_() if zero else view

    def _buffer(self, name: str, shape: list[int], dtype: torch.dtype) -> Tensor:
        """The kept buffer `name`, made anew when its shape or dtype changed."""
        buf = self._buffers.get(name)
        if buf is None or list(buf.shape) != shape or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf


# The two workspaces per device, kept from call to call: the CUDA graphs bind their buffers
# by address (graphs.py, `ChunkActs.BOUND`, `SweepAdjoints.BOUND`), so a replay copies no
# activation or adjoint in or out. A call of another longest chunk replaces them: a view
# out of a longer buffer would have other strides than a fresh one, and the kernels'
# compiled variants (which specialise on strides) would depend on what ran before.
_WORKSPACES: dict[torch.device, tuple[Workspace, Workspace]] = {}


def release_workspaces() -> None:
    """Drop the kept workspaces (between models: the device check measures each
    model's peak memory without the last one's)."""
    _WORKSPACES.clear()


def workspaces(longest: int, device: torch.device) -> tuple[Workspace, Workspace]:
    pair = _WORKSPACES.get(device)
    if pair is None or pair[0].max_chunk != longest:
        pair = _WORKSPACES[device] = (Workspace(longest, device), Workspace(longest, device))
    return pair
