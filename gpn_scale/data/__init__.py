"""Data loading: streamed MDS token windows, loader state, dataset metadata checks.

Datasets are written by `data_tools` (`gpn-data build`); see docs/data.md. The loader
names import torch and streaming on first use, so `data_tools` and the CLI stay light.
"""

from typing import Any

from gpn_scale.data.errors import DataError
from gpn_scale.data.metadata import (
    METADATA_FILE,
    DatasetMetadata,
    SplitInfo,
    check_compatible,
    read_metadata,
    write_metadata,
)
from gpn_scale.data.shm import clean_stale_streaming_shm

_LAZY = {"DataConfig", "TokenLoader", "build_loader", "collate_tokens"}

__all__ = [
    "DataConfig",
    "DataError",
    "DatasetMetadata",
    "METADATA_FILE",
    "SplitInfo",
    "TokenLoader",
    "build_loader",
    "check_compatible",
    "clean_stale_streaming_shm",
    "collate_tokens",
    "read_metadata",
    "write_metadata",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from gpn_scale.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'gpn_scale.data' has no attribute {name!r}")
