"""Where uploaded files' bytes live, behind one interface: a local directory (one replica, or
replicas sharing a volume) or an S3-compatible object store (replicas anywhere). Keys are
"<tenant id>/<file id>". The calls block: the API runs them in worker threads."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

CHUNK_BYTES = 1 << 20


class FileStorage(Protocol):
    def put(self, key: str, source: BinaryIO) -> None:
        """Store source's bytes (read from its current position) under key, whole or not at
        all."""

    def chunks(self, key: str) -> Iterator[bytes]:
        """The bytes stored under key, a piece at a time; FileNotFoundError when none."""

    def delete(self, key: str) -> None:
        """Remove key's bytes (nothing when there are none)."""


class LocalFileStorage:
    """Files under one directory; each written to a temporary name and renamed into place,
    so a reader never sees half a file."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"key {key!r} leaves the storage directory")
        return path

    def put(self, key: str, source: BinaryIO) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".upload-")
        try:
            with os.fdopen(handle, "wb") as out:
                shutil.copyfileobj(source, out, CHUNK_BYTES)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def chunks(self, key: str) -> Iterator[bytes]:
        with self._path(key).open("rb") as source:
            while piece := source.read(CHUNK_BYTES):
                yield piece

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


def file_storage(setting: str, data_dir: Path) -> FileStorage:
    """The storage --file-storage names: "local" (data_dir/files), a directory path, or
    "s3://bucket[/prefix]" (endpoint and credentials from boto3's usual environment:
    AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)."""
    if setting.startswith("s3://"):
        from gateway.files.s3_storage import S3FileStorage  # boto3 only where S3 is used

        bucket, _, prefix = setting.removeprefix("s3://").partition("/")
        return S3FileStorage(bucket, prefix)
    return LocalFileStorage(data_dir / "files" if setting == "local" else Path(setting))
