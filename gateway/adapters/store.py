"""The replica's local copies of adapter files, one directory per content
(`<model cache>/adapters/<sha256>/`): what the engine reads an adapter from.

The database holds every adapter's files (tenants.LoraAdapterBlob); a replica writes a
content's directory the first time a request needs it, so replicas share no filesystem.
A directory appears whole or not at all (written aside, then renamed), and its content is
checked against its name before it is used.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from gateway.adapters.archive import CONFIG, WEIGHTS, AdapterFiles

__all__ = ["AdapterStore", "content_hash"]


def content_hash(files: AdapterFiles) -> str:
    """SHA-256 over both files, each prefixed by its length (no two splits hash alike)."""
    digest = hashlib.sha256()
    for part in (files.config_json, files.weights):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


class AdapterStore:
    """Content-addressed adapter directories under root."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, digest: str) -> Path:
        return self.root / digest

    def has(self, digest: str) -> bool:
        return (self.root / digest / WEIGHTS).is_file()

    def write(self, digest: str, files: AdapterFiles) -> Path:
        """The content's directory, written now unless it is there already."""
        if content_hash(files) != digest:
            raise ValueError("the adapter's files do not match their content hash")
        target = self.root / digest
        if self.has(digest):
            return target
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=self.root))
        try:
            (staging / CONFIG).write_bytes(files.config_json)
            (staging / WEIGHTS).write_bytes(files.weights)
            try:
                os.rename(staging, target)
            except OSError:
                if not self.has(digest):  # not another writer's win: a real failure
                    raise
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        return target

    def remove(self, digest: str) -> None:
        """Delete the content's directory, if this replica has one: renamed aside first, so
        it is gone whole or not at all."""
        target = self.root / digest
        if not target.is_dir():
            return
        doomed = self.root / f".{digest[:12]}-removed-{os.getpid()}"
        try:
            os.rename(target, doomed)
        except OSError:
            return  # removed meanwhile
        shutil.rmtree(doomed, ignore_errors=True)
