"""The lines of a batch input file, checked as the file is uploaded: each a JSON object
{"custom_id", "method": "POST", "url", "body"} with a custom_id unique in the file, a url the
Batches API runs, and a body object that does not stream. A file with a bad line is refused
whole (400 naming the line); whether each body is a valid request of its url is found when the
batch runs (a bad one goes to the batch's error file, the others run)."""

from __future__ import annotations

import json
from typing import BinaryIO

from gateway.http.errors import BadRequestError

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_BATCH_LINES = 50_000
MAX_CUSTOM_ID_CHARS = 512
_LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})


def check_batch_lines(source: BinaryIO) -> int:
    """The number of requests in source (read from its start), or a 400 for its first bad
    line."""
    source.seek(0)
    seen: set[str] = set()
    count = 0
    for number, raw in enumerate(source, start=1):
        if not raw.strip():
            if source.read().strip():
                raise _bad_line(number, "is empty")
            break  # blank lines at the end of the file
        count += 1
        if count > MAX_BATCH_LINES:
            raise BadRequestError(f"a batch file holds at most {MAX_BATCH_LINES} requests",
                                  param="file")
        seen.add(_check_line(raw, number, seen))
    if count == 0:
        raise BadRequestError("the file holds no request", param="file")
    return count


def _check_line(raw: bytes, number: int, seen: set[str]) -> str:
    try:
        line = json.loads(raw)
    except UnicodeDecodeError:
        raise _bad_line(number, "is not UTF-8") from None
    except (ValueError, RecursionError):
        raise _bad_line(number, "is not valid JSON") from None
    if not isinstance(line, dict):
        raise _bad_line(number, "is not a JSON object")
    unknown = set(line) - _LINE_KEYS
    if unknown:
        raise _bad_line(number, f"has an unknown field {min(unknown)!r}")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        raise _bad_line(number, f"needs custom_id, a string of 1 to {MAX_CUSTOM_ID_CHARS} "
                                "characters")
    if custom_id in seen:
        raise _bad_line(number, f"repeats custom_id {custom_id!r}")
    if line.get("method") != "POST":
        raise _bad_line(number, 'needs method "POST"')
    if line.get("url") not in BATCH_URLS:
        raise _bad_line(number, f"needs url one of {', '.join(BATCH_URLS)}")
    body = line.get("body")
    if not isinstance(body, dict):
        raise _bad_line(number, "needs body, a JSON object")
    if body.get("stream") not in (None, False):
        raise _bad_line(number, "asks for a stream, which a batch cannot return")
    return custom_id


def _bad_line(number: int, problem: str) -> BadRequestError:
    return BadRequestError(f"line {number} of the file {problem}", param="file",
                           code="invalid_batch_line")
