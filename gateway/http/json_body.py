"""Request bodies parsed as JSON, with the two inputs JSON allows that must not reach the server.

- Nesting deeper than the parser recurses (100,000 nested arrays): Python's parser raises
  RecursionError, which used to surface as a 500 with a traceback.
- Lone surrogates: a `\\ud800` escape decodes to a str that is not text (no UTF-8 form); such
  a chat message was reported to drop the connection without a response. They are looked
  for only when the body holds a `\\ud8`-`\\udf` escape, so the common body pays one byte
  search.
- Numbers JSON can write but a double cannot hold: `1e400` (Python reads infinity) and the
  non-JSON literals NaN and Infinity that Python's parser accepts. Floats are checked as
  they are read (a body of token ids has none); an integer is exact in Python whatever its
  size, and is checked for range where it is used as a number (`temperature` written as a
  401-digit integer was an OverflowError, a 500).
All are a 400 invalid_request_error naming the field (`messages[0].content`, `prompt[1]`,
`temperature`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from starlette.requests import Request

from gateway.http.errors import BadRequestError

__all__ = ["declared_length", "parse_json_body"]

# A JSON escape of a UTF-16 surrogate (high D800-DBFF or low DC00-DFFF).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class _NonFinite(ValueError):
    """A float literal that reads as infinity (raised while parsing, found again after)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(text)
    return value


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON value")


def declared_length(request: Request) -> int | None:
    """The body size its Content-Length header declares; None without one or when it is not
    a plain number (the server then counts the bytes as they come)."""
    declared = request.headers.get("content-length")
    if declared is None or not declared.isascii() or not declared.isdigit() or len(declared) > 18:
        return None
    return int(declared)


def parse_json_body(raw: bytes) -> Any:
    """The body as JSON; BadRequestError when it is not JSON, nests too deeply, holds a
    string (or a key) that is not text, or a number no double holds."""
    try:
        body = json.loads(raw, parse_float=_finite_float, parse_constant=_refuse_constant)
    except RecursionError:
        raise BadRequestError("the request body nests too deeply") from None
    except _NonFinite as exc:
        # Read again, keeping infinities, to name the field that holds one.
        try:
            body = json.loads(raw, parse_constant=_refuse_constant)
        except (RecursionError, ValueError):
            raise _out_of_range(str(exc), None) from None
        raise _out_of_range(str(exc), _first(body, _is_infinite)) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):
        path = _first(body, _is_not_text)
        if path is not None:
            raise BadRequestError(
                "the request body holds a lone UTF-16 surrogate (not text)",
                param=path or None,
            )
    return body


def _out_of_range(what: str, path: str | None) -> BadRequestError:
    return BadRequestError(
        f"the number {what[:40]} is out of range: numbers must be finite doubles (below "
        f"1.8e308)",
        param=path or None,
    )


def _is_infinite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _first(value: Any, matches: Callable[[Any], bool], path: str = "") -> str | None:
    """The path of the first value (string, number) that matches, or of the object holding
    the first key that does; None when none does.
    Iterative: a body that parsed can still be too deep for a recursive walk."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            children = []
            for key, child in item.items():
                child_path = f"{where}.{key}" if where else key
                if matches(key):
                    return where  # "" at the top: the error then names no field
                children.append((child, child_path))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in reversed(list(enumerate(item))))
        elif matches(item):
            return where
    return None


def _is_not_text(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
