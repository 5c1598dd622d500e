"""One storage layer for everything the stack reads and writes outside the process: a local
(or shared) directory or an S3 prefix, with one endpoint rule, one credential chain, one retry
policy and one set of one-line errors. The data pipeline and the checkpoint manager both use it;
it imports nothing else of gpn_scale (each caller passes its own error type).

    from gpn_scale.io import open_storage
    store = open_storage("s3://bucket/prefix")      # or a directory
    store.put_bytes("a/b.json", b"{}"); store.get_bytes("a/b.json"); store.list("a/")

See gpn_scale/io/storage/__init__.py for the environment it reads.
"""

from gpn_scale.io.storage import (
    LocalStorage,
    ObjectInfo,
    RetryPolicy,
    S3Storage,
    Storage,
    StorageError,
    endpoint_url,
    is_s3,
    join,
    open_storage,
    s3_client,
    split_s3,
)

__all__ = [
    "LocalStorage",
    "ObjectInfo",
    "RetryPolicy",
    "S3Storage",
    "Storage",
    "StorageError",
    "endpoint_url",
    "is_s3",
    "join",
    "open_storage",
    "s3_client",
    "split_s3",
]
