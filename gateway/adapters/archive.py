"""An adapter's two files, from an uploaded archive or a directory on the server.

An upload is a zip or a tar (plain, gzip, bzip2 or xz) holding `adapter_config.json` and
`adapter_model.safetensors`, at its root or in one directory, and optionally the README.md
PEFT writes. Anything else is refused by name before a byte of it is kept: a pickled
`adapter_model.bin`, links and devices, paths that leave the archive, unknown files, and
contents above the size limit (counted as they are read, so a compressed bomb stops there).
"""

from __future__ import annotations

import io
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from engine import AdapterError

__all__ = ["AdapterFiles", "read_archive", "read_directory"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_IGNORED = frozenset({"README.md"})
_PICKLES = frozenset({"adapter_model.bin", "adapter_model.pt", "adapter_model.pth"})


@dataclass(frozen=True)
class AdapterFiles:
    config_json: bytes
    weights: bytes

    @property
    def size(self) -> int:
        return len(self.config_json) + len(self.weights)


def _member_name(raw: str) -> str:
    """The file name of an archive member at the root or one directory down."""
    path = PurePosixPath(raw)
    if path.is_absolute() or ".." in path.parts or len(path.parts) > 2 or not path.parts:
        raise AdapterError(f"archive member {raw!r} is not a file at the archive's root or in "
                           "one directory")
    name = path.name
    if name in _PICKLES:
        raise AdapterError(f"{name} is a pickle: only {WEIGHTS} is accepted")
    if name not in (CONFIG, WEIGHTS) and name not in _IGNORED:
        raise AdapterError(f"archive member {raw!r} is not part of a PEFT LoRA adapter "
                           f"({CONFIG} and {WEIGHTS})")
    return name


class _Budget:
    def __init__(self, max_bytes: int) -> None:
        self.left = max_bytes
        self.max_bytes = max_bytes

    def read(self, stream: IO[bytes], name: str) -> bytes:
        chunks: list[bytes] = []
        while True:
            chunk = stream.read(min(1 << 20, self.left + 1))
            if not chunk:
                return b"".join(chunks)
            self.left -= len(chunk)
            if self.left < 0:
                raise AdapterError(f"the adapter's files are over the limit of "
                                   f"{self.max_bytes} bytes (at {name})")
            chunks.append(chunk)


def _collect(found: dict[str, bytes]) -> AdapterFiles:
    for name in (CONFIG, WEIGHTS):
        if name not in found:
            raise AdapterError(f"{name} is missing")
    return AdapterFiles(found[CONFIG], found[WEIGHTS])


def _put(found: dict[str, bytes], name: str, data: bytes) -> None:
    if name in found:
        raise AdapterError(f"the archive holds {name} twice")
    found[name] = data


def read_archive(data: bytes, max_bytes: int) -> AdapterFiles:
    """The adapter's files from an uploaded zip or tar archive."""
    budget = _Budget(max_bytes)
    found: dict[str, bytes] = {}
    if zipfile.is_zipfile(io.BytesIO(data)):
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                for info in archive.infolist():
                    if info.is_dir():
                        continue
                    name = _member_name(info.filename)
                    if (info.external_attr >> 16) & 0o170000 not in (0, 0o100000):
                        raise AdapterError(f"archive member {info.filename!r} is not a file")
                    with archive.open(info) as opened:
                        content = budget.read(opened, info.filename)
                    if name not in _IGNORED:
                        _put(found, name, content)
        except (zipfile.BadZipFile, RuntimeError, ValueError) as exc:
            if isinstance(exc, AdapterError):
                raise
            raise AdapterError(f"the zip archive cannot be read ({exc})") from None
        return _collect(found)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
            for member in archive:
                if member.isdir():
                    continue
                name = _member_name(member.name)
                if not member.isfile():
                    raise AdapterError(f"archive member {member.name!r} is not a file")
                stream = archive.extractfile(member)
                if stream is None:
                    raise AdapterError(f"archive member {member.name!r} is not a file")
                content = budget.read(stream, member.name)
                if name not in _IGNORED:
                    _put(found, name, content)
    except tarfile.TarError as exc:
        raise AdapterError(f"the upload is neither a zip nor a tar archive ({exc})") from None
    return _collect(found)


def read_directory(path: Path, max_bytes: int) -> AdapterFiles:
    """The adapter's files from a directory on the server."""
    if not path.is_dir():
        raise AdapterError(f"{path} is not a directory")
    if not (path / WEIGHTS).is_file():
        pickled = sorted(name for name in _PICKLES if (path / name).exists())
        if pickled:
            raise AdapterError(f"{pickled[0]} is a pickle: only {WEIGHTS} is accepted")
    budget = _Budget(max_bytes)
    found: dict[str, bytes] = {}
    for name in (CONFIG, WEIGHTS):
        file = path / name
        if not file.is_file():
            raise AdapterError(f"{name} is missing")
        with file.open("rb") as stream:
            found[name] = budget.read(stream, name)
    return _collect(found)
