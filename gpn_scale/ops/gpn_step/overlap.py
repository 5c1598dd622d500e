"""The chunk-wide work of the backward beside the reverse sweep (issue 34, item 4).

The reverse sweep of chunk k is a chain of latency-bound launches; the parallel recompute of
chunk k-1 (it needs only the forward's saved states) and the weight gradients of chunk k+1
(they need only that chunk's adjoints) are wide GEMMs that do not wait on it. On CUDA they
run on a second stream, ordered against the sweep by events; everything they compute is
computed by the same ops in the same order as without overlap, so the gradients are
bit-identical (held by tests/ops/test_overlap.py).

Three forms of one small interface (`submit` a piece of side work after a point of the main
stream, `get` its result on the main stream, `mark` a point):

- `Inline`: the work runs when submitted (CPU, meta, overlap off): the plain order;
- `Deferred`: the work runs as late as the main stream's `get`s allow (tests on CPU: a buffer
  the sweep reuses before the side work has read it then shows as a wrong gradient);
- `CudaSide`: a second CUDA stream. Tensors the main stream allocated and the side work reads
  are marked with `record_stream`, so the allocator does not hand their memory out again
  before the side work has run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import Tensor

from gpn_scale.ops.execution import current

T = TypeVar("T")
Held = Callable[[T], Iterable[Tensor]]
DEFERRED = "deferred"  # Execution.side_work: run side work as late as possible (tests)


class Future(Generic[T]):
    """The result of one piece of side work; `SideWork.get` hands it to the main stream."""

    def __init__(self) -> None:
        self.value: T | None = None
        self.done = False
        self.event: Any = None  # the CUDA event recorded after it (CudaSide)


class SideWork(Protocol):
    def mark(self) -> Any:
        """A point on the main stream that later side work can be ordered after."""
        ...

    def submit(
        self, work: Callable[[], T], after: Any = None, reads: Iterable[Tensor] = ()
    ) -> Future[T]:
        """Run `work` beside the main stream, after the main stream's point `after`;
        `reads`: tensors the main stream allocated that `work` reads."""
        ...

    def get(self, future: Future[T], held: Held[T] | None = None) -> T:
        """The result, usable on the main stream from here on; `held(result)`: the tensors in
        it that the side work allocated (the main stream's use of them must end before their
        memory is reused)."""
        ...

    def join(self) -> None:
        """The main stream waits for all side work submitted so far."""
        ...


class Inline:
    def mark(self) -> Any:
        return None

    def submit(
        self, work: Callable[[], T], after: Any = None, reads: Iterable[Tensor] = ()
    ) -> Future[T]:
        future: Future[T] = Future()
        future.value, future.done = work(), True
        return future

    def get(self, future: Future[T], held: Held[T] | None = None) -> T:
        return future.value  # type: ignore[return-value]

    def join(self) -> None:
        pass


class Deferred(Inline):
    def __init__(self) -> None:
        self.queue: deque[tuple[Future[Any], Callable[[], Any]]] = deque()

    def submit(
        self, work: Callable[[], T], after: Any = None, reads: Iterable[Tensor] = ()
    ) -> Future[T]:
        future: Future[T] = Future()
        self.queue.append((future, work))
        return future

    def get(self, future: Future[T], held: Held[T] | None = None) -> T:
        while not future.done:  # side work runs in submission order, as on one stream
            queued, work = self.queue.popleft()
            queued.value, queued.done = work(), True
        return future.value  # type: ignore[return-value]

    def join(self) -> None:
        while self.queue:
            self.get(self.queue[-1][0])


class CudaSide:
    def __init__(self, device: torch.device) -> None:
        self.main = torch.cuda.current_stream(device)
        self.side = torch.cuda.Stream(device)

    def mark(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.main)
        return event

    def submit(
        self, work: Callable[[], T], after: Any = None, reads: Iterable[Tensor] = ()
    ) -> Future[T]:
        future: Future[T] = Future()
        if after is not None:
            self.side.wait_event(after)
        with torch.cuda.stream(self.side):
            future.value = work()
        for tensor in reads:
            tensor.record_stream(self.side)
        future.event = torch.cuda.Event()
        future.event.record(self.side)
        return future

    def get(self, future: Future[T], held: Held[T] | None = None) -> T:
        if not future.done:
            self.main.wait_event(future.event)
            future.done = True
        for tensor in held(future.value) if held is not None else ():  # type: ignore[arg-type]
            tensor.record_stream(self.main)
        return future.value  # type: ignore[return-value]

    def join(self) -> None:
        self.main.wait_stream(self.side)


def side_work(device: torch.device, overlap: bool) -> SideWork:
    """The form for a backward on `device` (see the module docstring)."""
    if current().side_work == DEFERRED:
        return Deferred()
    if overlap and device.type == "cuda":
        return CudaSide(device)
    return Inline()
