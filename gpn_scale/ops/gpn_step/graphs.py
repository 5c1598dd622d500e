"""CUDA graphs for the CUDA step backend: each chunk's forward steps and each chunk's reverse
sweep captured once per shape and replayed per chunk.

A graph replays fixed kernels on fixed addresses, so every chunk's inputs are copied into
static buffers, the graph replays, and its outputs are copied out (the engine keeps each
chunk's carry, so a static output is never handed out as is). The loop weights are copied
once per engine call (the engine passes the same `LoopWeights` object for every chunk of a
call; a new object means new values). Scratch buffers the kernels allocate during capture
live in one private memory pool.

Everything except the capture call itself is plain Python over tensors: `capture_with`
swaps the capture for an eager stand-in, so the tests run the static-buffer logic (copies
in, replay, copies out) on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from gpn_scale.ops.gpn_step.interface import (
    ChunkForward,
    ChunkForwardResult,
    LoopWeights,
    ReverseSweep,
    ReverseSweepResult,
    StepPlan,
)

Capture = Callable[[Callable[[], Any]], tuple[Callable[[], None], Any]]


def _cuda_capture(fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """Warm up on a side stream (Triton compiles there), then capture `fn` into a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=_pool()):
        out = fn()
    return graph.replay, out


def _eager_capture(fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
    """The capture's stand-in for tests: 'replaying' runs `fn` again and copies its results
    into the first call's outputs, as a graph writes into its static outputs."""
    out = fn()

    def replay() -> None:
        for dst, src in zip(_leaves(out), _leaves(fn())):
            dst.copy_(src)

    return replay, out


_POOL = None
_capture: Capture = _cuda_capture


def _pool():
    global _POOL
    if _POOL is None:
        _POOL = torch.cuda.graph_pool_handle()
    return _POOL


@contextlib.contextmanager
def capture_with(capture: Capture | None = None) -> Iterator[None]:
    """Within the block graphs are 'captured' by `capture` (default: the eager stand-in) and
    wanted on any device: for tests of everything around the CUDA call."""
    global _capture, _ANY_DEVICE
    previous = (_capture, _ANY_DEVICE)
    _capture, _ANY_DEVICE = capture or _eager_capture, True
    try:
        yield
    finally:
        _capture, _ANY_DEVICE = previous


_ANY_DEVICE = False


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


def _signature(obj: Any) -> tuple:
    """What a graph's addresses and kernels depend on: the tree's structure and every
    tensor's shape, strides and dtype."""
    if obj is None:
        return (None,)
    if isinstance(obj, Tensor):
        return (tuple(obj.shape), obj.stride(), obj.dtype)
    if dataclasses.is_dataclass(obj):
        return tuple(_signature(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(item) for item in obj)
    return (obj,)


def _static_like(obj: Any) -> Any:
    return _rebuild(obj, iter([t.clone() for t in _leaves(obj)]))


def _copy_into(dst: Any, src: Any) -> None:
    for d, s in zip(_leaves(dst), _leaves(src)):
        d.copy_(s)


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
    """The captured graphs of one CUDA backend, by (phase, plan, shapes)."""

    def __init__(self) -> None:
        self._graphs: dict[tuple, _Graph] = {}
        self.failed: str | None = None
        self.captures = 0
        self.replays = 0

    def wanted(self, plan: StepPlan, like: Tensor) -> bool:
        from gpn_scale.ops.gpn_step.cuda import is_dry

        return (
            plan.cuda_graphs
            and self.failed is None
            and not is_dry()
            and (like.is_cuda or _ANY_DEVICE)
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
        _copy_into(sweep.adjoints, graph.inputs.adjoints)  # what the sweep added to
        return _rebuild(graph.outputs, iter([t.clone() for t in _leaves(graph.outputs)]))

    def _get(
        self, key: tuple, plan: StepPlan, W: LoopWeights, args: Any, run: Callable[..., Any]
    ) -> _Graph | None:
        key = (*key, _signature(args), _signature(W))
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        inputs, weights = _static_like(args), _static_like(W)
        try:
            replay, outputs = _capture(lambda: run(plan, weights, inputs))
        except Exception as exc:  # capture is not possible here: eager from now on
            self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            from gpn_scale.ops.gpn_step.registry import warn_once

            warn_once(
                f"CUDA graph capture of the step chunks failed ({self.failed}); running "
                "them eagerly (set model.cuda_graphs=false to skip the attempt)"
            )
            return None
        self.captures += 1
        graph = _Graph(inputs, weights, replay, outputs, weakref.ref(W))
        self._graphs[key] = graph
        return graph

    def _replay(self, graph: _Graph, W: LoopWeights, args: Any) -> None:
        if graph.weights_of is None or graph.weights_of() is not W:
            _copy_into(graph.weights, W)
            graph.weights_of = weakref.ref(W)
        _copy_into(graph.inputs, args)
        graph.replay()
        self.replays += 1
