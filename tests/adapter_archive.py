"""A LoRA adapter directory as the tar.gz an admin uploads (the gateway and console tests)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def adapter_tar_gz(directory: Path, extra: dict[str, bytes] | None = None,
                   skip: tuple[str, ...] = ()) -> bytes:
    """The directory's files (but skip) in one folder of a tar.gz, then extra's members."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path in sorted(directory.iterdir()):
            if path.name not in skip:
                archive.add(path, arcname=f"adapter/{path.name}")
        for name, data in (extra or {}).items():
            info = tarfile.TarInfo(f"adapter/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
