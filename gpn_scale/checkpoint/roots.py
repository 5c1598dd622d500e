"""The storage of a checkpoint root, without torch: what `gpn-scale sweep` and
slurm/train.sbatch read on login and batch nodes (DONE markers, leases) imports only this."""

from __future__ import annotations

from typing import Any

from gpn_scale.checkpoint.errors import CheckpointError
from gpn_scale.io import storage as io_storage
from gpn_scale.io.storage import Storage


def open_storage(uri: str, **s3_options: Any) -> Storage:
    """The storage of a checkpoint root (gpn_scale.io: a directory or s3://bucket/prefix),
    failing with CheckpointErrors that speak of the checkpoint root.

    `s3_options` (retries, backoff_s, multipart_mb) go to S3Storage; ignored for local roots."""
    return io_storage.open_storage(
        uri, error=CheckpointError, subject="checkpoint root", **s3_options
    )
