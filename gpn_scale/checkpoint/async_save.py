"""Background checkpoint saves: `checkpoint.async_mode` (torchtitan's AsyncMode names).

    off                     the save runs whole while training waits (CheckpointManager.save)
    async                   training waits only while the state is copied to CPU; DCP's
                            write, the rank files, the upload and the commit run in a
                            background thread while the next steps train
    async_with_pinned_mem   the same, the copy into page-locked CPU buffers kept from one save
                            to the next (a GPU's copy then runs at full speed; on a machine
                            without CUDA the buffers are plain ones, said once)

As torchtitan's CheckpointManager with `dcp.async_save`: at most one save is in flight (a
new save waits for the previous one first), and the background's collectives (DCP's
planning, the file lists, the commit's broadcast) run on a gloo process group of their own,
so they never meet the training's collectives on the default group from another thread.
The commit protocol is the synchronous one (manifest, then `latest`): a job killed during a
background write or upload leaves the previous checkpoint the newest complete one. A
background save that fails raises its one-line CheckpointError at the next `save` or
`wait` (the end of training, a preemption), or is said by `close` at exit: never lost.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from gpn_scale.checkpoint.errors import CheckpointError, one_line

ASYNC_MODES = ("off", "async", "async_with_pinned_mem")


def check_async_mode(mode: str) -> str:
    """`mode` when it is one of ASYNC_MODES, else a one-line CheckpointError."""
    if mode not in ASYNC_MODES:
        raise CheckpointError(
            f"checkpoint.async_mode: expected one of {', '.join(ASYNC_MODES)}, got {mode!r}"
        )
    return mode


class StagedCopy:
    """Copies of state dicts off the training tensors, on CPU: a tensor into a CPU tensor
    of its own (a DTensor: its local shard, wrapped in a DTensor of the same spec, so DCP
    writes the same shards), every other value deep-copied. `pinned`: page-locked buffers,
    allocated once and reused by later saves with the same shapes (pinning is slow; the
    copy from a GPU into them is fast and runs non-blocking until one synchronize)."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned and torch.cuda.is_available()
        self._buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def copy(self, value: Any) -> Any:
        out = self._walk(value, "")
        if self.pinned:
            torch.cuda.synchronize()  # the non-blocking copies have landed
        return out

    def _walk(self, value: Any, key: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, key)
        if isinstance(value, dict):
            return {k: self._walk(v, f"{key}/{k}") for k, v in value.items()}
        if isinstance(value, list | tuple):
            items = [self._walk(v, f"{key}/{i}") for i, v in enumerate(value)]
            return items if isinstance(value, list) else type(value)(items)
        return copy.deepcopy(value)

    def _tensor(self, t: torch.Tensor, key: str) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        local = t.to_local() if isinstance(t, DTensor) else t
        buf = self._buffers.get(key) if self.pinned else None
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            buf = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=self.pinned)
            if self.pinned:
                self._buffers[key] = buf
        buf.copy_(local.detach(), non_blocking=self.pinned)
        if isinstance(t, DTensor):
            # DTensor.from_local would move a CPU shard back to a GPU mesh's device.
            return DTensor(buf, t._spec, requires_grad=False)
        return buf


class AsyncSaver:
    """One rank's background saves into `mgr` (a CheckpointManager). Every rank calls
    `save` at the same step (its synchronous part is collective on the default group);
    `wait` on every rank before anything reads the checkpoint as saved."""

    def __init__(self, mgr: Any, mode: str, log: Callable[[str], None]) -> None:
        self.mgr, self.mode, self.log = mgr, check_async_mode(mode), log
        self._staging = StagedCopy(pinned=mode == "async_with_pinned_mem")
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[str] | None = None
        self._step: int | None = None
        self._group: Any = None
        self.blocking_s = 0.0  # the last save's synchronous part (staging included)
        if mode == "async_with_pinned_mem" and not self._staging.pinned:
            log(
                "checkpoint.async_mode=async_with_pinned_mem: no CUDA here; staging in plain memory"
            )

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def _background_group(self) -> Any:
        """The background's process group (collective: every rank creates it at its first
        save); None in one process."""
        if self._group is None and dist.is_available() and dist.is_initialized():
            if dist.get_world_size() > 1:
                self._group = dist.new_group(backend="gloo")
        return self._group

    def save(
        self,
        step: int,
        app_state: dict[str, Any],
        *,
        meta: dict[str, Any],
        rank_state: dict[str, Any] | None,
        files: dict[str, bytes] | None,
    ) -> str:
        """COLLECTIVE. Wait for the save in flight (its error raises here), start this one
        and stage the state; returns the URI it commits to once done in the background."""
        self.wait()
        t0 = time.perf_counter()
        group = self._background_group()
        name, stage = self.mgr.begin_save(step, meta)
        staged = self._staging.copy({"app": app_state, "rank": rank_state, "meta": meta})
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="gpn-ckpt-save")
        self._future = self._pool.submit(
            self.mgr.write_and_commit,
            step,
            name,
            stage,
            staged["app"],
            meta=staged["meta"],
            rank_state=staged["rank"],
            files=dict(files or {}),
            group=group,
        )
        self._step = step
        self.blocking_s = time.perf_counter() - t0
        return str(self.mgr.storage.child_uri(name))

    def wait(self) -> str | None:
        """The save in flight, committed: its URI (None: none in flight); a failed one
        raises its one-line CheckpointError (once)."""
        future, step = self._future, self._step
        if future is None:
            return None
        try:
            return future.result()
        except CheckpointError as err:
            raise CheckpointError(f"background save of step {step} failed: {err}") from None
        except Exception as exc:  # noqa: BLE001 - a surprise in the thread, said in one line
            raise CheckpointError(
                f"background save of step {step} failed: {one_line(exc, 200)}; the previous "
                "latest is unchanged"
            ) from exc
        finally:
            self._future = self._step = None

    def close(self) -> str | None:
        """At exit: wait for the save in flight; its failure as one line (returned, not
        raised: the run's own outcome or error stands), else None."""
        try:
            self.wait()
            return None
        except CheckpointError as err:
            return str(err)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
