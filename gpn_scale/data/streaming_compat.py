"""Every place the project reaches into mosaicml-streaming's private API, and their check.

streaming (pinned: `STREAMING_PIN`) works for us only with patches: its dataset's threads hang
or print tracebacks on a failed download, its shared-memory handles live until exit, its S3
downloader ignores our retries. Those patches use names streaming does not promise to keep
(underscored methods, instance attributes, module tables). They all live here:

- `PRIVATE`: each private name a patch relies on (module, attribute path, expected
  parameters, the attributes or globals its code must still touch, and who uses it);
- `check()`: compares them with the installed streaming (inspect.signature and code-object
  names: well under a millisecond) and raises one line naming what moved, the installed
  version and the supported pin. `import_streaming()` (the loader's way in) runs it once per
  process, so an upgrade fails at the first loader built, not as a hang mid-run;
- the patches: `patched_dataset_class()` (six StreamingDataset overrides), the
  `SharedMemory.__init__` hook and the handle release it serves, `shut_down()`,
  `install_s3_downloader()` (streaming's `s3://` downloader swapped for one whose transfers
  are gpn_scale.io's, data/s3_download.py), and the shared-memory prefix a node's ranks
  agree on (data/streaming_prefix.py, installed with the dataset class).

The loader's own `TokenStreamingDataset.__iter__` (error translation, loader.py) overrides
only public API and stays there. `streaming_import.py` keeps the cheap import (its stand-ins
for streaming's transformers imports and deferred packages are declared in `PRIVATE` too;
it falls back to a plain import by itself). `shm.py` reads streaming's /dev/shm names and
`_locals` format without importing streaming; the names that produce them are declared here.
tests/data/test_streaming_compat.py checks each declaration and a simulated upgrade.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import inspect
import threading
import time
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gpn_scale.data.errors import DataError
from gpn_scale.data.streaming_import import import_streaming as _import_streaming

# Keep equal to pyproject.toml's and constraints.txt's pin (a test compares them).
STREAMING_PIN = "mosaicml-streaming==0.13.0"
SUPPORTED_VERSIONS = ("0.13.0",)


@dataclass(frozen=True)
class Private:
    """One private name of streaming a patch relies on."""

    module: str  # e.g. "streaming.base.dataset"
    name: str  # attribute path in the module, e.g. "StreamingDataset._resume"
    params: tuple[str, ...] | None = None  # expected parameter names; None: not a callable
    uses: tuple[str, ...] = ()  # names its code must still touch (attributes set, globals read)
    used_by: str = ""  # the project code that needs it

    @property
    def where(self) -> str:
        return f"{self.module}.{self.name}"


_DS = "streaming.base.dataset"
_SHM = "streaming.base.shared.memory"
_DL = "streaming.base.storage.download"
_PATCHED = "streaming_compat.patched_dataset_class"

PRIVATE: tuple[Private, ...] = (
    # The seven StreamingDataset members the loader overrides (six here, __iter__ in loader.py).
    Private(_DS, "StreamingDataset.on_exception", ("self", "future"), used_by=_PATCHED),
    Private(
        _DS,
        "StreamingDataset.prepare_shard",
        ("self", "shard_id", "blocking"),
        ("_shard_states",),
        _PATCHED,
    ),  # fmt: skip
    Private(_DS, "StreamingDataset._prepare_thread", ("self", "it"), used_by=_PATCHED),
    Private(_DS, "StreamingDataset._ready_thread", ("self", "it"), used_by=_PATCHED),
    Private(_DS, "StreamingDataset.load_state_dict", ("self", "obj"), used_by=_PATCHED),
    Private(_DS, "StreamingDataset._resume", ("self", "world", "epoch"), used_by=_PATCHED),
    # __iter__ starts the threads whose failures on_exception records (in _event, read by
    # the threads), and leaves _iterator/_executor for shut_down to stop.
    Private(
        _DS,
        "StreamingDataset.__iter__",
        ("self",),
        (
            "_iterator",
            "_executor",
            "_event",
            "on_exception",
            "_prepare_thread",
            "_ready_thread",
            "_resume_incr_epoch",
        ),
        "loader.TokenStreamingDataset.__iter__, streaming_compat.shut_down",
    ),  # fmt: skip
    Private(_DS, "StreamingDataset._resume_incr_epoch", ("self",), ("_resume",), _PATCHED),
    Private(
        _DS,
        "StreamingDataset.__init__",
        None,
        ("_shm_prefix_int", "_shard_states"),
        "streaming_compat.registered_prefix, patched prepare_shard",
    ),  # fmt: skip
    Private(_DS, "_ShardState.PREPARING", used_by="patched prepare_shard"),
    Private(_DS, "_ShardState.LOCAL", used_by="patched prepare_shard"),
    Private(_DS, "_Iterator.on_exit", ("self",), used_by="patched _prepare/_ready_thread"),
    Private(_DS, "_Iterator.exit", ("self",), used_by="streaming_compat.shut_down"),
    # Every handle registers its own exit handler: the hook collects, release_handle undoes.
    Private(
        _SHM,
        "SharedMemory.__init__",
        ("self", "name", "create", "size", "auto_cleanup"),
        ("atexit", "cleanup"),
        "streaming_compat.collect_shared_memory",
    ),  # fmt: skip
    Private(_SHM, "SharedMemory.cleanup", ("self",), used_by="streaming_compat.release_handle"),
    # The s3:// downloader swap.
    Private(_DL, "DOWNLOADER_MAPPINGS", used_by="streaming_compat.install_s3_downloader"),
    Private(
        _DL,
        "CloudDownloader.get",
        ("remote_dir",),
        ("DOWNLOADER_MAPPINGS",),
        "streaming_compat.install_s3_downloader",
    ),  # fmt: skip
    Private(
        _DL,
        "S3Downloader._download_file_impl",
        ("self", "remote", "local", "timeout"),
        used_by="streaming_compat.S3Downloader",
    ),  # fmt: skip
    Private(
        _DL,
        "S3Downloader.__init__",
        ("self",),
        ("_requester_pays_buckets",),
        "streaming_compat.S3Downloader",
    ),  # fmt: skip
    # What shm.py reads from /dev/shm and $TMPDIR: `NNNNNN_<name>` segments and filelocks,
    # and the `_locals` segment's layout.
    Private(
        "streaming.base.shared.prefix",
        "_get_path",
        ("prefix_int", "name"),
        used_by="shm (segment names)",
    ),  # fmt: skip
    Private(
        "streaming.base.shared.prefix",
        "_pack_locals",
        ("dirnames", "prefix_int"),
        used_by="shm._registered_locals",
    ),  # fmt: skip
    # The prefix a node's ranks agree on (`streaming_prefix`): the dataset's registration
    # reads the first free prefix through this scan, on every rank.
    Private(
        "streaming.base.shared.prefix",
        "get_shm_prefix",
        ("streams_local", "streams_remote", "world", "retry"),
        ("_check_and_find_retrying", "SHM_TO_CLEAN"),
        "streaming_prefix.agreed_shm_prefix",
    ),  # fmt: skip
    Private(_DS, "get_shm_prefix", used_by="streaming_prefix.install_agreed_shm_prefix"),
    Private(
        "streaming.base.shared.prefix",
        "_check_and_find_retrying",
        ("streams_local", "streams_remote", "shm_name", "retry"),
        used_by="streaming_prefix.agreed_shm_prefix",
    ),  # fmt: skip
    Private("streaming.base.constant", "LOCALS", used_by="shm (the _locals segment)"),
    Private("streaming.base.constant", "BARRIER_FILELOCK", used_by="shm (filelocks)"),
    Private("streaming.base.constant", "CACHE_FILELOCK", used_by="shm (filelocks)"),
    # streaming_import's stand-ins: the transformers names streaming.base.dataloader imports
    # for its batch count, and the packages whose __init__ it defers.
    Private("streaming.base.dataloader", "BatchEncoding", used_by="streaming_import"),
    Private("streaming.base.dataloader", "BatchFeature", used_by="streaming_import"),
    Private(
        "streaming.base.dataloader",
        "StreamingDataLoader._get_batch_size",
        ("self", "batch"),
        ("BatchEncoding", "BatchFeature"),
        "streaming_import",
    ),  # fmt: skip
    Private("streaming", "text", used_by="streaming_import (deferred package)"),
    Private("streaming", "vision", used_by="streaming_import (deferred package)"),
    Private("streaming", "multimodal", used_by="streaming_import (deferred package)"),
)

# Values shm.py assumes (its segment and lock names are built from these).
CONSTANTS = {
    "streaming.base.constant.LOCALS": "locals",
    "streaming.base.constant.BARRIER_FILELOCK": "barrier_filelock",
    "streaming.base.constant.CACHE_FILELOCK": "cache_filelock",
}

# Texts of streaming's errors that the loader recognises (loader.translate_stream_error,
# build_loader): checked against streaming's source by the tests, not at run time.
MESSAGES = (
    ("streaming.base.stream", "Checksum failure: "),
    ("streaming.base.stream", "Index file at "),
    ("streaming.base.dataset", "the cache limit"),
    ("streaming.base.shared.prefix", "Reused local directory"),
)


class StreamingCompatError(DataError):
    """The installed streaming lacks or changed a private name the patches need (one line)."""


def installed_version(streaming: types.ModuleType | None = None) -> str:
    module = streaming if streaming is not None else _import_streaming()
    return str(getattr(module, "__version__", "unknown"))


def _resolve(entry: Private) -> Any:
    obj: Any = importlib.import_module(entry.module)
    for part in entry.name.split("."):
        obj = getattr(obj, part)  # AttributeError: moved
    return obj


def _code_names(obj: Any) -> set[str]:
    """The global and attribute names a function's code touches, its comprehensions' too."""
    func = inspect.unwrap(getattr(obj, "__func__", obj))
    code = getattr(func, "__code__", None)
    names: set[str] = set()
    stack = [code] if code is not None else []
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


def problem(entry: Private) -> str:
    """What is wrong with `entry` in the installed streaming ('' when it matches)."""
    try:
        obj = _resolve(entry)
    except (AttributeError, ImportError):
        return f"{entry.where} moved (not found; used by {entry.used_by})"
    if entry.params is not None:
        try:
            found = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            found = None
        if found != entry.params:
            got = f"({', '.join(found)})" if found is not None else "no signature"
            want = f"({', '.join(entry.params)})"
            return f"{entry.where} changed (expected params {want}, found {got})"
    missing = [name for name in entry.uses if name not in _code_names(obj)]
    if missing:
        return f"{entry.where} changed (no longer uses {', '.join(missing)})"
    expected = CONSTANTS.get(entry.where)
    if expected is not None and obj != expected:
        return f"{entry.where} changed (expected {expected!r}, found {obj!r})"
    return ""


def check(streaming: types.ModuleType | None = None) -> None:
    """Raise StreamingCompatError (one line) when a name in `PRIVATE` moved or changed; warn
    when the version is not the pinned one but every name still matches."""
    module = streaming if streaming is not None else _import_streaming()
    version = installed_version(module)
    problems = [p for p in map(problem, PRIVATE) if p]
    if problems:
        raise StreamingCompatError(
            f"mosaicml-streaming {version}: {'; '.join(problems)}; this project supports "
            f"streaming {' or '.join(SUPPORTED_VERSIONS)} ({STREAMING_PIN}); pin it with "
            "constraints.txt (pip install -c constraints.txt -e .)"
        )
    if version not in SUPPORTED_VERSIONS:
        warnings.warn(
            f"mosaicml-streaming {version} is not the tested {' or '.join(SUPPORTED_VERSIONS)}; "
            f"the private names the loader patches still match, but pin {STREAMING_PIN} "
            "(constraints.txt) for the tested behaviour",
            stacklevel=2,
        )


_CHECK_LOCK = threading.Lock()
_CHECKED = False


def import_streaming() -> types.ModuleType:
    """`import streaming` (cheaply, data/streaming_import.py), checked once per process."""
    global _CHECKED
    module = _import_streaming()
    if not _CHECKED:
        with _CHECK_LOCK:
            if not _CHECKED:
                check(module)
                _CHECKED = True
    return module


# --------------------------------------------------------------------------------------------
# StreamingDataset: six overrides (the loader subclasses this for __iter__).

_RESUME_ATTACH_TRIES = 8  # 0.01 s doubling: 2.5 s in all
_CLASS_LOCK = threading.Lock()
_DATASET_CLASS: type | None = None


def _make_patched_dataset_class() -> type:
    import_streaming()
    from streaming import StreamingDataset

    from gpn_scale.data.streaming_prefix import install_agreed_shm_prefix

    install_agreed_shm_prefix()

    class PatchedStreamingDataset(StreamingDataset):
        """StreamingDataset that remembers failures of its download threads (whose exceptions
        otherwise reach the caller only as 'Background thread failed'), and neither hangs
        nor leaks on them."""

        _background_error: BaseException | None = None

        def on_exception(self, future: Any) -> None:
            # streaming's own version re-raises inside the future's done-callback, where
            # concurrent.futures can only log it: a 30-90 line traceback on stderr before
            # our one-line error. Keep its effect (stop the other threads), record the error
            # for __iter__ to raise in the main thread, and raise nothing here.
            error = future.exception()
            if error is not None:
                self._background_error = error
                self._event.set()

        def prepare_shard(self, shard_id: int, blocking: bool = True) -> None:
            try:
                return super().prepare_shard(shard_id, blocking)
            except BaseException:
                _unblock_waiters(self, shard_id)
                raise

        # streaming's download threads report their exit (it.on_exit()) only when they end
        # normally; one that dies by an exception never does, and the epoch's it.exit() then
        # waits for it forever (seen as a rare hang on a corrupt shard). Report it anyway.
        def _prepare_thread(self, it: Any) -> None:
            try:
                super()._prepare_thread(it)
            except BaseException:
                it.on_exit()
                raise

        def _ready_thread(self, it: Any) -> None:
            try:
                super()._ready_thread(it)
            except BaseException:
                it.on_exit()
                raise

        def load_state_dict(self, obj: dict[str, Any]) -> None:
            # Every rank of a node writes the same resume state into one segment named by
            # the node's prefix: the first creates it, the others attach after streaming's
            # one tick, and on a loaded node may find it created but not yet sized ("cannot
            # mmap an empty file": a tp = 4 resume in the full suite). Attach again, a little
            # later each time; the creator sizes it within microseconds of creating it.
            for attempt in range(_RESUME_ATTACH_TRIES):
                try:
                    return super().load_state_dict(obj)
                except ValueError as err:
                    if "empty file" not in str(err) or attempt == _RESUME_ATTACH_TRIES - 1:
                        raise
                    time.sleep(0.01 * 2**attempt)

        def _resume(self, world: Any, epoch: int) -> tuple[int, int]:
            # streaming opens the resume state's segment (left by load_state_dict) here at
            # the start of every epoch, reads it, and keeps the handle until the process
            # exits: one descriptor per epoch of a restored loader. Close it after reading.
            with collect_shared_memory() as opened:
                try:
                    return super()._resume(world, epoch)
                finally:
                    release_handles(opened)

    return PatchedStreamingDataset


def _unblock_waiters(dataset: Any, shard_id: int) -> None:
    """After a failed `prepare_shard`: streaming leaves a shard whose download failed in state
    PREPARING, and every other worker/rank of the node then waits for it forever (a hang, not
    an error). Their wait loops end only on LOCAL, so mark it LOCAL: a reader then finds the
    file missing and takes streaming's own recovery path (re-download + hash check), which
    fails again in *its* main thread and reports the error (or succeeds, if the failure was
    transient)."""
    try:
        from streaming.base.dataset import _ShardState

        if dataset._shard_states[shard_id] == _ShardState.PREPARING:
            dataset._shard_states[shard_id] = _ShardState.LOCAL
    except Exception:  # noqa: BLE001 - best effort; the original error matters
        pass


def patched_dataset_class() -> type:
    """StreamingDataset with the six overrides above (made once, on first use)."""
    global _DATASET_CLASS
    with _CLASS_LOCK:
        if _DATASET_CLASS is None:
            _DATASET_CLASS = _make_patched_dataset_class()
        return _DATASET_CLASS


def registered_prefix(dataset: Any) -> int:
    """The shared-memory prefix number the dataset registered (its /dev/shm NNNNNN_*)."""
    return int(dataset._shm_prefix_int)


# --------------------------------------------------------------------------------------------
# SharedMemory handles.
#
# streaming's SharedMemory registers `atexit.register(self.cleanup)` for every handle it
# creates or opens: the handle, and the descriptor of its segment, then live until the process
# exits, whether or not anything else still refers to it. Two of its callers drop handles at
# once: the prefix walk of every StreamingDataset construction opens each existing prefix's six
# segments (on every rank) to find a free prefix, and `_resume` opens the resume state each
# epoch. And a dataset that is collected without close() leaves all of its handles behind.
# So the handles streaming creates during those calls are collected here (per thread) and the
# ones nothing keeps are released.
_SHM_COLLECTING = threading.local()
_SHM_HOOK_LOCK = threading.Lock()


def _install_shared_memory_hook() -> None:
    """Make streaming's SharedMemory report each new handle to this thread's innermost
    `collect_shared_memory` block, if any (otherwise it behaves as before). Once per process."""
    import_streaming()
    from streaming.base.shared.memory import SharedMemory

    with _SHM_HOOK_LOCK:
        if getattr(SharedMemory.__init__, "_gpn_collecting", False):
            return
        original = SharedMemory.__init__

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            blocks = getattr(_SHM_COLLECTING, "blocks", None)
            if blocks:
                blocks[-1].append(self)

        __init__._gpn_collecting = True  # type: ignore[attr-defined]
        SharedMemory.__init__ = __init__  # type: ignore[method-assign]


@contextlib.contextmanager
def collect_shared_memory() -> Iterator[list[Any]]:
    """The streaming SharedMemory handles this thread creates inside the block."""
    _install_shared_memory_hook()
    blocks = _SHM_COLLECTING.__dict__.setdefault("blocks", [])
    opened: list[Any] = []
    blocks.append(opened)
    try:
        yield opened
    finally:
        blocks.pop()


def release_handle(shm: Any) -> None:
    """Close a streaming SharedMemory handle (and unlink its segment if it created it), and
    drop its exit handler: that handler kept the handle alive, and run again at exit it would
    unlink by name a segment that another loader or job may have registered since."""
    try:
        shm.cleanup()
    except Exception:  # noqa: BLE001 - e.g. BufferError, a view still open: exit cleans it
        return
    atexit.unregister(shm.cleanup)


def release_handles(handles: list[Any], keep: object = None) -> None:
    """Release the handles, except those the dataset `keep` holds."""
    kept = {id(shm) for shm in shared_memory_of(keep)} if keep is not None else set()
    for shm in handles:
        if id(shm) not in kept:
            release_handle(shm)


def shared_memory_of(dataset: object) -> list[Any]:
    """streaming's SharedMemory objects reachable from the dataset's attributes (its barrier,
    scalars and arrays hold theirs one or two levels down), each once."""
    import_streaming()
    from streaming.base.shared.memory import SharedMemory

    found: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[object, int]] = [(dataset, 0)]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, SharedMemory):
            found.append(obj)
            continue
        if depth < 3 and hasattr(obj, "__dict__"):
            stack.extend((value, depth + 1) for value in vars(obj).values())
    return found


def release_shared_memory(dataset: object) -> None:
    """Release the dataset's SharedMemory handles: the segments they created are unlinked,
    those they opened closed."""
    for shm in shared_memory_of(dataset):
        release_handle(shm)


def shut_down(loader: Any, dataset: Any) -> None:
    """Stop a StreamingDataLoader's workers and its dataset's download threads now, and
    release the dataset's shared memory (what `TokenLoader.close` does)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    # streaming's download threads of the main process (num_workers=0) run on until the
    # epoch ends: stop them and wait, so that nothing is written into the cache after
    # close() (a failed start removes the cache it had made)
    epoch = getattr(dataset, "_iterator", None)
    if epoch is not None and hasattr(epoch, "exit"):
        epoch.exit()
    executor = getattr(dataset, "_executor", None)
    if executor is not None:
        executor.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(AttributeError):
            del dataset._executor
    release_shared_memory(dataset)


# --------------------------------------------------------------------------------------------
# The s3:// downloader.

_S3_CLASS: type | None = None


def _make_s3_downloader_class() -> type:
    import_streaming()
    from streaming.base.storage.download import S3Downloader as StreamingS3Downloader

    from gpn_scale.data import s3_download

    class S3Downloader(StreamingS3Downloader):
        """streaming's S3 downloader, its transfers made by gpn_scale.io (data/s3_download.py)."""

        _gpn = True

        def _download_file_impl(self, remote: str, local: str, timeout: float) -> None:
            s3_download.download_file(remote, local, self._requester_pays_buckets)

    S3Downloader.__module__ = __name__
    S3Downloader.__qualname__ = "S3Downloader"
    return S3Downloader


def s3_downloader_class() -> type:
    """The S3Downloader subclass (made once: it subclasses streaming's, imported lazily)."""
    global _S3_CLASS
    with _CLASS_LOCK:
        if _S3_CLASS is None:
            _S3_CLASS = _make_s3_downloader_class()
        return _S3_CLASS


def install_s3_downloader() -> None:
    """Make streaming download `s3://` through `S3Downloader` (this process; DataLoader
    workers get the dataset's downloader objects pickled, of this class). Idempotent."""
    cls = s3_downloader_class()
    from streaming.base.storage import download

    download.DOWNLOADER_MAPPINGS["s3"] = cls


def __getattr__(name: str) -> Any:
    # `S3Downloader` by name, for pickling into DataLoader workers (they unpickle by module
    # and qualname, and this class is made on first use).
    if name == "S3Downloader":
        return s3_downloader_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
