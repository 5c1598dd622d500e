"""Loading checkpoint files without ever running pickled code.

Three places in a checkpoint are pickles, and all three are closed here:
- tensors inside DCP `.distcp` files: DCP already loads them with `torch.load(weights_only=True)`;
- non-tensor values in DCP files (optimizer param_groups, python scalars): DCP's default planner
  uses `torch.load(weights_only=False)`, so `SafeLoadPlanner` replaces that with weights_only=True;
- DCP's `.metadata` file: DCP uses plain `pickle.load`, so `SafeFileSystemReader` reads it with
  an unpickler that only knows DCP's own metadata dataclasses and a few torch value types.
Per-rank state files and DeepSpeed files go through `safe_torch_load` (weights_only=True).
Any refusal is a CheckpointDamaged (a CheckpointError) naming the file: `--resume auto` falls
back to an older checkpoint on it.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from gpn_scale.checkpoint.errors import CheckpointDamaged, one_line

# Modules whose dataclasses/enums may appear in DCP metadata. Classes only: calling a dataclass
# or enum constructor with pickled arguments cannot run anything else.
_DCP_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint._extension",
    "torch.distributed.checkpoint.stateful",
)


def _enum_member(cls: Any, name: Any) -> enum.Enum:
    """`builtins.getattr` as some Pythons pickle an enum member (3.11.2 writes DCP's
    `_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT` as getattr(_MEM_FORMAT_ENCODING, name);
    3.11.7 calls the class): only a member name of an enum class, which itself can only come
    from `find_class`'s allowed set, is looked up; anything else is refused."""
    if (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and isinstance(name, str)
        and name in cls.__members__
    ):
        return cls[name]
    raise pickle.UnpicklingError(
        "getattr in checkpoint metadata is allowed only for an enum member"
    )


_SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("builtins", "getattr"): _enum_member,
    ("torch", "Size"): torch.Size,
    (
        "torch.serialization",
        "_get_layout",
    ): torch.serialization._get_layout,  # name -> torch.layout lookup
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PurePosixPath,  # never instantiate a concrete foreign path
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[(module, name)]
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.memory_format)
        ):
            return getattr(torch, name)
        if module in _DCP_MODULES:
            import importlib

            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type) and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
            ):
                return obj
            if isinstance(obj, (dict, enum.Enum)):  # e.g. _MEM_FORMAT_ENCODING members
                return obj
        raise pickle.UnpicklingError(
            f"global '{module}.{name}' is not allowed in checkpoint metadata"
        )


def _why(exc: BaseException) -> str:
    """torch's weights_only refusal is a page of advice; keep the line that names the global."""
    m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc)) or re.search(
        r"Unsupported operand \d+", str(exc)
    )
    if m:
        return f"{type(exc).__name__}: {m.group(0)}"
    return one_line(exc, 200)


def safe_unpickle_metadata(data: bytes, what: str) -> Any:
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001
        raise CheckpointDamaged(
            f"refusing to load {what}: it is not plain DCP metadata ({one_line(exc)}); the "
            "checkpoint is corrupt or was tampered with, pick another"
        ) from exc


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is read with the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = safe_unpickle_metadata(f.read(), str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = _weights_only_load(value)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointDamaged(
                f"refusing to unpickle checkpoint value '{read_item.dest_index.fqn}' "
                f"({_why(exc)}); "
                "checkpoints may hold only tensors and plain python values"
            ) from exc
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _weights_only_load(
    source: Any, extra_safe_globals: Iterable[Any] = (), map_location: str | None = None
) -> Any:
    """torch.load(weights_only=True), also reading enum members pickled as getattr(Enum, name)
    (Python 3.11.2 does that) through `_enum_member`, never through the real getattr."""
    allowed = [(_enum_member, "builtins.getattr"), *extra_safe_globals]
    with torch.serialization.safe_globals(allowed):
        return torch.load(source, map_location=map_location, weights_only=True)


def safe_torch_load(path: Path, *, extra_safe_globals: Iterable[Any] = ()) -> Any:
    """torch.load(weights_only=True) with a one-line CheckpointError on refusal."""
    try:
        return _weights_only_load(path, extra_safe_globals, map_location="cpu")
    except Exception as exc:  # noqa: BLE001
        raise CheckpointDamaged(
            f"refusing to load {path}: not loadable with weights_only=True ({_why(exc)}); "
            "checkpoints may hold only tensors and plain python values"
        ) from exc


# Plain data classes/enums DeepSpeed pickles into its optimizer-state files (found with
# torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO-1/2 fp32 checkpoints). Classes
# only: the weights_only unpickler instantiates them and sets attributes, nothing else runs.
_DEEPSPEED_GLOBALS = (
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)


def deepspeed_safe_globals() -> list[Any]:
    """The DeepSpeed classes allowed in weights_only loads of DeepSpeed checkpoint files."""
    import importlib

    out = []
    for dotted in _DEEPSPEED_GLOBALS:
        module, _, name = dotted.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed version: that type cannot occur
            continue
    return out


def deepspeed_safe_load(path: str) -> Any:
    """A DeepSpeed checkpoint file, weights_only (its checkpoint engine's `load`)."""
    return safe_torch_load(Path(path), extra_safe_globals=deepspeed_safe_globals())
