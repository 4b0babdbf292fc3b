"""The whole JSON schema, checked against each finished output.

The grammar enforces, token by token, what llguidance can express of a schema; it compiles the
rest leniently (engine.output_spec.JSON_SCHEMA_OPTIONS: keywords it does not implement are left
out, and `oneOf` is read as `anyOf`), so the grammar admits a superset of what the schema
allows.
What the grammar left out is checked here, once per finished output, with a reference
validator (jsonschema-rs, Draft 2020-12 unless the schema's `$schema` names another draft, with
the formats checked): an output that fails the check is never returned as valid. Unstreamed,
it is sampled again (gateway.openai.generation.STRUCTURED_OUTPUT_RESAMPLES, at temperatures
above 0); then, or streamed, its request ends with a 400 `structured_output_invalid` that names
the keyword and the place in the output (streams: an error event after the text). Every
attempt's tokens are billed. Remote `$ref`s are never
fetched: a schema that needs one is refused with a 400 that names it and its path.

The check runs on the event loop: jsonschema-rs validates a reply of a few thousand tokens in
microseconds, and its regular expressions are linear-time or step-limited (no catastrophic
backtracking from a tenant's `pattern`). Validators are kept for the schemas sent again.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import jsonschema_rs

from engine import StructuredOutput, subschemas
from gateway.http.errors import BadRequestError

__all__ = ["SchemaCheck", "schema_check"]

_CACHE_SIZE = 256  # validators kept, least recently used dropped first
_MESSAGE_CHARS = 300  # of a validation message quoted to a client


class SchemaCheck:
    """One schema's validator: what a finished output must satisfy."""

    def __init__(self, validator: Any) -> None:
        self._validator = validator

    def problem(self, text: str) -> str | None:
        """None when text is a JSON document the schema accepts; else what is wrong with it,
        for its client (the first error: keyword, schema path and place in the output)."""
        try:
            instance = json.loads(text)
        except (ValueError, RecursionError):
            return "the output is not a JSON document"
        try:
            for error in self._validator.iter_errors(instance):
                keyword = next((str(p) for p in reversed(error.schema_path)
                                if not isinstance(p, int)), "schema")
                where = "/" + "/".join(str(p) for p in error.instance_path)
                at = "/" + "/".join(str(p) for p in error.schema_path)
                return (f"the output does not match the schema: {error.message[:_MESSAGE_CHARS]}"
                        f" (keyword {keyword!r} at {at}, output {where})")
        except RecursionError:
            return "the output is nested too deeply to check"
        return None


_cache: OrderedDict[str, SchemaCheck] = OrderedDict()
_lock = threading.Lock()


def schema_check(constraint: StructuredOutput) -> SchemaCheck:
    """The check of a json_schema constraint's finished outputs (kept for the next request
    with the same schema); BadRequestError naming the constraint's field for a schema the
    validator refuses, or one that needs a remote `$ref`."""
    assert constraint.kind == "json_schema"
    with _lock:
        check = _cache.get(constraint.source)
        if check is not None:
            _cache.move_to_end(constraint.source)
            return check
    schema = json.loads(constraint.source)
    try:
        validator = jsonschema_rs.validator_for(schema, validate_formats=True, offline=True)
    except jsonschema_rs.ValidationError as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid schema"
        remote = _remote_ref(schema, message)
        if remote is not None:
            ref, path = remote
            raise BadRequestError(
                f"remote $ref {ref!r} is not supported: a schema must hold every schema it "
                f"refers to ($defs), and name a standard draft as its $schema",
                param=f"{constraint.param}{path}") from None
        raise BadRequestError(f"invalid json schema: {message[:_MESSAGE_CHARS]}",
                              param=constraint.param) from None
    except (ValueError, RecursionError) as exc:
        raise BadRequestError(f"invalid json schema: {str(exc)[:_MESSAGE_CHARS]}",
                              param=constraint.param) from None
    check = SchemaCheck(validator)
    with _lock:
        _cache[constraint.source] = check
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return check


def _remote_ref(schema: object, message: str) -> tuple[str, str] | None:
    """The `$ref` (`$dynamicRef`, `$schema`) and its path (`.a.b` form) whose resource the
    validator could not find, as its message names it; None when the message is about
    something else."""
    if "not present in a registry" not in message and "Unknown meta-schema" not in message:
        return None
    stack: list[tuple[object, str]] = [(schema, "")]
    first: tuple[str, str] | None = None
    while stack:
        item, path = stack.pop()
        if not isinstance(item, dict):
            continue
        for key in ("$ref", "$dynamicRef", "$schema"):
            ref = item.get(key)
            if isinstance(ref, str) and not ref.startswith("#"):
                resource = ref.split("#", 1)[0]
                if resource and resource in message:
                    return ref, f"{path}.{key}"
                first = first or (ref, f"{path}.{key}")
        stack.extend((sub, f"{path}{where}") for where, sub in subschemas(item))
    return first
