"""A Files API upload: a multipart/form-data body with one `file` part and a `purpose`
field, read with its size bounded (413 past --max-file-bytes, counted as it arrives: a body
that never ends is cut there), the file spooled to a temporary file rather than memory."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import BinaryIO

from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from gateway.http.errors import BadRequestError, PayloadTooLargeError
from gateway.http.json_body import declared_length

# What a form may add to the file's bytes (boundaries, part headers, the purpose field).
FORM_OVERHEAD_BYTES = 64 << 10
MAX_FILENAME_CHARS = 256


@dataclass
class Upload:
    purpose: str
    filename: str
    file: BinaryIO  # positioned at its start
    size: int

    def close(self) -> None:
        self.file.close()


async def read_upload(request: Request, max_file_bytes: int) -> Upload:
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise BadRequestError("upload a file as multipart/form-data with fields file and "
                              "purpose", param="file")
    max_body = max_file_bytes + FORM_OVERHEAD_BYTES
    declared = declared_length(request)
    if declared is not None and declared > max_body:
        raise _too_large(max_file_bytes)
    parser = MultiPartParser(request.headers, _bounded(request.stream(), max_body,
                                                       max_file_bytes),
                             max_files=1, max_fields=4, max_part_size=FORM_OVERHEAD_BYTES)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise BadRequestError(f"the upload is not a valid form: {exc.message}",
                              param="file") from None
    file, purpose = form.get("file"), form.get("purpose")
    if not isinstance(file, UploadFile):
        await form.close()
        raise BadRequestError("the form needs a file part named file", param="file")
    if not isinstance(purpose, str) or not purpose:
        await form.close()
        raise BadRequestError("the form needs a purpose field", param="purpose")
    size = file.size or 0
    if size > max_file_bytes:
        await form.close()
        raise _too_large(max_file_bytes)
    filename = (file.filename or "upload.jsonl")[-MAX_FILENAME_CHARS:]
    file.file.seek(0)
    return Upload(purpose, filename, file.file, size)


async def _bounded(stream: AsyncGenerator[bytes, None], max_body: int,
                   max_file_bytes: int) -> AsyncGenerator[bytes, None]:
    size = 0
    async for piece in stream:
        size += len(piece)
        if size > max_body:
            raise _too_large(max_file_bytes)
        yield piece


def _too_large(max_file_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"the file is larger than this server's {max_file_bytes} "
                                "bytes (--max-file-bytes)")
