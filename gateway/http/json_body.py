"""Request bodies parsed as JSON, with the two inputs JSON allows that must not reach the server.

- Nesting deeper than the parser recurses (100,000 nested arrays): Python's parser raises
  RecursionError, which used to surface as a 500 with a traceback.
- Lone surrogates: a `\\ud800` escape decodes to a str that is not text (no UTF-8 form); such
  a chat message was reported to drop the connection without a response. They are looked
  for only when the body holds a `\\ud8`-`\\udf` escape, so the common body pays one byte
  search.
Both are a 400 invalid_request_error naming the field (`messages[0].content`, `prompt[1]`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.http.errors import BadRequestError

__all__ = ["parse_json_body"]

# A JSON escape of a UTF-16 surrogate (high D800-DBFF or low DC00-DFFF).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def parse_json_body(raw: bytes) -> Any:
    """The body as JSON; BadRequestError when it is not JSON, nests too deeply, or holds
    a string (or a key) that is not text."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequestError("the request body nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):
        path = _first_non_text(body, "")
        if path is not None:
            raise BadRequestError(
                "the request body holds a lone UTF-16 surrogate (not text)",
                param=path or None,
            )
    return body


def _first_non_text(value: Any, path: str) -> str | None:
    """The path of the first string (or the object holding the first key) with a lone
    surrogate, None when there is none.
    Iterative: a body that parsed can still be too deep for a recursive walk."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not _is_text(item):
                return where
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                child_path = f"{where}.{key}" if where else key
                if not _is_text(key):
                    return where  # "" at the top: the error then names no field
                children.append((child, child_path))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in reversed(list(enumerate(item))))
    return None


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
