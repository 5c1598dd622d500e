"""CUDA graphs for the CUDA step backend: each chunk's forward steps and each chunk's reverse
sweep captured once per shape and replayed per chunk.

A graph replays fixed kernels on fixed addresses, so every chunk's inputs are copied into
static buffers, the graph replays, and its outputs are copied out (the engine keeps each
chunk's carry, so a static output is never handed out as is). Buffers the kernels write
whole and never read (the interface's `WRITTEN_WHOLE` fields: the forward's P and S) are
copied out only; the activations only the weight gradients read (`SWEEP_NEVER_READS`) not
at all. The sweep's adjoints and the recomputed activations it reads live in the engine's
two workspaces, which stay where they are from chunk to chunk and call to call
(`SweepAdjoints.BOUND`, ~1.8 GB a chunk at 130M and B = 128; `ChunkActs.BOUND`, ~2.8 GB): a
reverse graph binds them by address (its key holds them), so a replay copies none of them,
and there is one reverse graph per workspace. The loop weights are copied
once per engine call (the engine passes the same `LoopWeights` object for every chunk of a
call; a new object means new values). Scratch buffers the kernels allocate during capture
live in one private memory pool.

A graph is keyed on the shapes and dtypes of its chunk (not the strides of the views it is
given: the static copies are compact, so a new window length reuses the graphs of its
chunk shape) and on its bound buffers' addresses, and the cache holds at most `max_graphs`
of them, least recently used first out: the graphs of one chunk shape (a forward and two
reverse) held ~6 GiB of static copies at 130M and B = 128 while the reverse graphs copied
the activations in (the bound buffers are not the graphs' own), so a sweep over batch
sizes must not keep them all; six hold the two shapes of a window that a last partial
chunk or a truncated-BPTT cut splits. `clear()`
drops every graph (the device check calls it between models). Running out of memory during
a capture is raised (the caller's batch is too large); any other capture failure turns
graphs off for this backend, with one warning, and the chunks run eagerly.

Everything except the capture call itself is plain Python over tensors:
`execution(graph_capture=eager_capture)` (ops/execution.py) swaps the capture for an eager
stand-in, so the tests run the static-buffer logic (copies in, replay, copies out) on CPU
under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from gpn_scale.ops.backends import warn_once
from gpn_scale.ops.execution import current
from gpn_scale.ops.gpn_step.interface import (
    ChunkForward,
    ChunkForwardResult,
    LoopWeights,
    ReverseSweep,
    ReverseSweepResult,
    StepPlan,
)
from gpn_scale.ops.launch import is_dry

Capture = Callable[[Callable[[], Any]], tuple[Callable[[], None], Any]]


def _cuda_capture(fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """Warm up on a side stream (Triton compiles there), then capture `fn` into a graph.

    The reverse sweep is captured inside autograd's backward, which runs on autograd's own
    device thread: "thread_local" capture mode lets other threads (the main thread waiting
    on backward, a data-loader's pinned-memory thread) keep calling CUDA meanwhile."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=_pool(), capture_error_mode="thread_local"):
        out = fn()
    return graph.replay, out


def eager_capture(fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """The capture's stand-in for tests (`execution(graph_capture=eager_capture)`: graphs are
    then wanted on any device): 'replaying' runs `fn` again and copies its results into the
    first call's outputs, as a graph writes into its static outputs."""
    out = fn()

    def replay() -> None:
        for dst, src in zip(_leaves(out), _leaves(fn())):
            dst.copy_(src)

    return replay, out


_POOL = None


def _pool():
    global _POOL
    if _POOL is None:
        _POOL = torch.cuda.graph_pool_handle()
    return _POOL


# ------------------------------------------------------------------- tensor trees
def _leaves(obj: Any) -> list[Tensor]:
    """The tensors of a dataclass / list / tuple tree, in field order (None skipped)."""
    if obj is None:
        return []
    if isinstance(obj, Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _leaves(getattr(obj, f.name))]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _leaves(item)]
    return []


def _rebuild(obj: Any, tensors: Iterator[Tensor]) -> Any:
    """The same tree with its tensors taken in order from `tensors`."""
    if isinstance(obj, Tensor):
        return next(tensors)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj,
            **{f.name: _rebuild(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj)},
        )
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(item, tensors) for item in obj)
    return obj


def _signature(obj: Any, strides: bool = False) -> tuple:
    """What a graph's kernels depend on: the tree's structure and every tensor's shape and
    dtype (and, `strides`, its strides: for the weights, whose static copies keep theirs)."""
    if obj is None:
        return (None,)
    if isinstance(obj, Tensor):
        return (tuple(obj.shape), obj.dtype, *((obj.stride(),) if strides else ()))
    if dataclasses.is_dataclass(obj):
        return tuple(_signature(getattr(obj, f.name), strides) for f in dataclasses.fields(obj))
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(item, strides) for item in obj)
    return (obj,)


def _static_like(obj: Any, keep_strides: bool = False) -> Any:
    """Static copies of a tree's tensors: compact (contiguous) ones, or (`keep_strides`, the
    loop weights, padded for aligned rows) with the same strides. A dataclass's `BOUND`
    fields are the caller's own tensors, not copies (the graph binds them by address); the
    fields no kernel reads (`SWEEP_NEVER_READS`) are left out (an empty list, or None)."""
    if isinstance(obj, Tensor):
        if keep_strides:
            copy = torch.empty_strided(obj.shape, obj.stride(), dtype=obj.dtype, device=obj.device)
            return copy.copy_(obj)
        return obj.clone(memory_format=torch.contiguous_format)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        bound = getattr(obj, "BOUND", ())
        unread = getattr(obj, "SWEEP_NEVER_READS", ())

        def field(name: str) -> Any:
            value = getattr(obj, name)
            if name in bound:
                return value
            if name in unread:
                return [] if isinstance(value, list) else None
            return _static_like(value, keep_strides)

        return dataclasses.replace(obj, **{f.name: field(f.name) for f in dataclasses.fields(obj)})
    if isinstance(obj, (list, tuple)):
        return type(obj)(_static_like(item, keep_strides) for item in obj)
    return obj


def _copy_into(dst: Any, src: Any) -> None:
    for d, s in zip(_leaves(dst), _leaves(src)):
        d.copy_(s)


def _without(obj: Any, declared: str) -> Any:
    """The tree with the fields its dataclasses list in their ClassVar `declared` emptied
    (a list field: [], any other: None)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        skip = getattr(obj, declared, ())
        return dataclasses.replace(
            obj,
            **{
                f.name: (
                    ([] if isinstance(getattr(obj, f.name), list) else None)
                    if f.name in skip
                    else _without(getattr(obj, f.name), declared)
                )
                for f in dataclasses.fields(obj)
            },
        )
    return obj


def _unread(obj: Any) -> Any:
    """The tree without the fields no step kernel reads (`SWEEP_NEVER_READS`: the chunk
    activations only the weight gradients use)."""
    return _without(obj, "SWEEP_NEVER_READS")


def unbound(obj: Any) -> Any:
    """The tree without its dataclasses' `BOUND` fields (the buffers a graph binds by
    address: neither copied in nor out)."""
    return _without(obj, "BOUND")


def _read_part(obj: Any) -> Any:
    """What a replay copies in: the tree without the fields the kernels never read, those
    its dataclasses declare `WRITTEN_WHOLE` (buffers the kernels fill and never read), and
    the bound ones."""
    return unbound(_without(_unread(obj), "WRITTEN_WHOLE"))


def _bound_leaves(obj: Any) -> list[Tensor]:
    """The tree's tensors in its dataclasses' `BOUND` fields."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return []
    bound = getattr(obj, "BOUND", ())
    found: list[Tensor] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        found += _leaves(value) if f.name in bound else _bound_leaves(value)
    return found


def _addresses(obj: Any) -> tuple:
    """Where the tree's `BOUND` tensors live (and how they are laid out): part of a graph's
    key, since its kernels read and write them there."""
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in _bound_leaves(obj))


def replay_copy_bytes(args: Any, copied_out: Any, outputs: Any) -> int:
    """What one replay moves besides its kernels, each copy a read and a write: the call's
    inputs the kernels read (`_read_part`), copied in; what they wrote into the call's own
    buffers (`copied_out`), copied back; the captured outputs, cloned. (The launch
    accounting's record of a replay, ops/gpn_step/cuda.py.)"""
    moved = [*_leaves(_read_part(args)), *_leaves(copied_out), *_leaves(outputs)]
    return 2 * sum(t.numel() * t.element_size() for t in moved)


@dataclasses.dataclass
class _Graph:
    inputs: Any  # static copies of the call's tensor arguments
    weights: LoopWeights  # static copies of the loop weights
    replay: Callable[[], None]
    outputs: Any  # the captured call's result (static)
    weights_of: Any = None  # weakref to the LoopWeights last copied in


def _plan_key(plan: StepPlan) -> tuple:
    return (
        plan.n_layers,
        plan.memory,
        plan.H,
        plan.dk,
        plan.dv,
        plan.d,
        plan.f,
        plan.eps,
        plan.mm_dtype,
        plan.tp_size,  # under tp the graph also holds the group's collectives
        id(plan.tp_group) if plan.tp_group is not None else None,
    )


class ChunkGraphs:
    """The captured graphs of one CUDA backend, by (phase, plan, shapes): at most
    `max_graphs`, the least recently used dropped first."""

    def __init__(self, max_graphs: int = 6) -> None:
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.max_graphs = max_graphs
        self.failed: str | None = None
        self.captures = 0
        self.replays = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drop every graph and its static buffers (and forget an earlier capture failure)."""
        self._graphs.clear()
        self.failed = None

    def wanted(self, plan: StepPlan, like: Tensor) -> bool:
        return (
            plan.options.cuda_graphs
            and self.failed is None
            and not is_dry()
            and (like.is_cuda or current().graph_capture is not None)
        )

    def forward(
        self,
        plan: StepPlan,
        W: LoopWeights,
        chunk: ChunkForward,
        run: Callable[[StepPlan, LoopWeights, ChunkForward], ChunkForwardResult],
    ) -> ChunkForwardResult:
        graph = self._get(("forward", _plan_key(plan)), plan, W, chunk, run)
        if graph is None:
            return run(plan, W, chunk)
        self._replay(graph, W, chunk)
        # P and S are written by the kernels into the static inputs: copy them out.
        chunk.P.copy_(graph.inputs.P)
        if chunk.S is not None:
            chunk.S.copy_(graph.inputs.S)
        return _rebuild(graph.outputs, iter([t.clone() for t in _leaves(graph.outputs)]))

    def reverse(
        self,
        plan: StepPlan,
        Wt: LoopWeights,
        sweep: ReverseSweep,
        run: Callable[[StepPlan, LoopWeights, ReverseSweep], ReverseSweepResult],
    ) -> ReverseSweepResult:
        graph = self._get(("reverse", _plan_key(plan)), plan, Wt, sweep, run)
        if graph is None:
            return run(plan, Wt, sweep)
        self._replay(graph, Wt, sweep)
        # what the sweep added to or wrote, but the bound buffers (written in place)
        _copy_into(unbound(sweep.adjoints), unbound(graph.inputs.adjoints))
        return _rebuild(graph.outputs, iter([t.clone() for t in _leaves(graph.outputs)]))

    def _get(
        self, key: tuple, plan: StepPlan, W: LoopWeights, args: Any, run: Callable[..., Any]
    ) -> _Graph | None:
        key = (*key, _signature(args), _addresses(args), _signature(W, strides=True))
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            return graph
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
            self.evictions += 1
        inputs, weights = _static_like(args), _static_like(W, keep_strides=True)
        # Capturing runs the kernels once (the warm-up; the eager stand-in's call) on the
        # bound buffers themselves: what they held goes back before the first replay.
        bound = _bound_leaves(args)
        held = [t.clone() for t in bound]
        try:
            replay, outputs = (current().graph_capture or _cuda_capture)(
                lambda: run(plan, weights, inputs)
            )
        except torch.OutOfMemoryError:
            raise  # the batch does not fit with its graphs: the caller's to handle
        except Exception as exc:  # capture is not possible here: eager from now on
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warn_once(
                f"CUDA graph capture of the step chunks failed ({self.failed}); running "
                "them eagerly (set engine.cuda_graphs=false to skip the attempt)"
            )
            return None
        finally:
            for t, value in zip(bound, held):
                t.copy_(value)
        self.captures += 1
        graph = _Graph(inputs, weights, replay, outputs, weakref.ref(W))
        self._graphs[key] = graph
        return graph

    def _replay(self, graph: _Graph, W: LoopWeights, args: Any) -> None:
        if graph.weights_of is None or graph.weights_of() is not W:
            _copy_into(graph.weights, W)
            graph.weights_of = weakref.ref(W)
        _copy_into(_read_part(graph.inputs), _read_part(args))
        graph.replay()
        self.replays += 1
