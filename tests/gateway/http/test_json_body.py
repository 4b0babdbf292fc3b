"""gateway.http.json_body: what JSON allows and the server must refuse, a 400 naming the field."""

from __future__ import annotations

import pytest

from gateway.http.errors import BadRequestError
from gateway.http.json_body import parse_json_body


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        (b'{"prompt": ["ok", "x\\uDFFFy"]}', "prompt[1]"),
        (b'{"a": {"b\\udc00": 1}}', "a"),  # a key: the object holding it
        (b'{"\\ud800": 1}', None),  # a top-level key: no field to name
        (b'"\\udbff"', None),
    ],
)
def test_lone_surrogates_are_refused_with_their_field(raw: bytes, param: str | None) -> None:
    with pytest.raises(BadRequestError, match="surrogate") as caught:
        parse_json_body(raw)
    assert caught.value.param == param and caught.value.status_code == 400


def test_surrogate_pairs_and_plain_text_pass() -> None:
    body = parse_json_body(b'{"content": "\\ud83d\\ude00 and \\u00e9", "n": [1, {"x": "y"}]}')
    assert body == {"content": "\U0001f600 and \u00e9", "n": [1, {"x": "y"}]}


def test_deep_nesting_is_a_400() -> None:
    with pytest.raises(BadRequestError, match="nests too deeply"):
        parse_json_body(b"[" * 100_000 + b"]" * 100_000)


def test_a_deep_but_parseable_body_is_walked_without_recursion() -> None:
    depth = 900  # under the parser's limit, deep enough to matter for a recursive walk
    raw = b'{"prompt": ' + b"[" * depth + b'"\\ud800"' + b"]" * depth + b"}"
    with pytest.raises(BadRequestError) as caught:
        parse_json_body(raw)
    assert caught.value.param == "prompt" + "[0]" * depth


def test_not_json_is_a_400() -> None:
    with pytest.raises(BadRequestError, match="not valid JSON"):
        parse_json_body(b"{not json")


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"temperature": 1e400}', "temperature"),
        (b'{"response_format": {"json_schema": {"schema": {"minimum": -1e400}}}}',
         "response_format.json_schema.schema.minimum"),
        (b'{"tools": [{"function": {"parameters": {"maximum": 1' + b"0" * 400 + b'.5}}}]}',
         "tools[0].function.parameters.maximum"),
        (b"[1, 2.5, 9e999]", "[2]"),
    ],
)
def test_numbers_past_a_double_are_refused_with_their_field(raw: bytes, param: str) -> None:
    with pytest.raises(BadRequestError, match="out of range") as caught:
        parse_json_body(raw)
    assert caught.value.param == param and caught.value.status_code == 400


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_json_number_literals_are_refused(literal: bytes) -> None:
    """Python's parser reads them; JSON has no such values."""
    with pytest.raises(BadRequestError, match="not a JSON value"):
        parse_json_body(b'{"top_p": ' + literal + b"}")


def test_numbers_within_a_double_pass() -> None:
    body = parse_json_body(b'{"a": 1.7e308, "b": -1e-400, "c": 1' + b"0" * 400 + b"}")
    assert body == {"a": 1.7e308, "b": -0.0, "c": 10**400}  # an integer is exact in Python
