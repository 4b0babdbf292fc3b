"""Uploaded files in an S3-compatible object store (AWS S3, MinIO, Ceph, moto's server in the
tests): every replica reads what any replica wrote. Needs boto3 (`pip install boto3`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, BinaryIO

from gateway.files.storage import CHUNK_BYTES


class S3FileStorage:
    def __init__(self, bucket: str, prefix: str = "", client: Any = None) -> None:
        if client is None:
            import boto3

            client = boto3.client("s3")
        self._client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, source: BinaryIO) -> None:
        # One object written whole: S3 never shows a partly uploaded one.
        self._client.upload_fileobj(source, self.bucket, self._key(key))

    def chunks(self, key: str) -> Iterator[bytes]:
        try:
            body = self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except self._client.exceptions.NoSuchKey:
            raise FileNotFoundError(key) from None
        try:
            yield from body.iter_chunks(CHUNK_BYTES)
        finally:
            body.close()

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
