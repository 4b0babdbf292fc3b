"""Request bodies against the OpenAI schema: what is accepted, and the param of each 400."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.http.errors import BadRequestError
from gateway.openai.requests import Endpoint, parse_chat_request, parse_completion_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def test_chat_defaults_follow_openai() -> None:
    request = parse_chat_request(CHAT)
    assert request.endpoint is Endpoint.CHAT
    sampling = request.sampling
    assert (sampling.n, sampling.temperature, sampling.top_p) == (1, 1, 1)
    assert sampling.max_tokens is None
    assert sampling.num_logprobs is None and not request.stream and not request.include_usage


def test_chat_fields_are_read() -> None:
    request = parse_chat_request({
        **CHAT,
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be "},
                                              {"type": "text", "text": "brief"}]},
            {"role": "user", "content": "hi", "name": "ann"},
        ],
        "max_tokens": 5, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 3,
        "stop": "END", "seed": 3, "n": 2, "stream": True,
        "stream_options": {"include_usage": True}, "top_k": 4, "min_p": 0.1, "user": "u1",
        "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
    })
    assert request.messages[0] == {"role": "system", "content": "be brief"}
    assert request.messages[1]["name"] == "ann"
    s = request.sampling
    assert (s.max_tokens, s.num_logprobs, s.stop, s.seed, s.n, s.top_k, s.min_p) == (
        7, 3, ("END",), 3, 2, 4, 0.1)
    assert request.stream and request.include_usage and request.user == "u1"


@pytest.mark.parametrize(
    ("fields", "kind", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": {"type": "object", "additionalProperties": False},
            "strict": True}}}, "json_schema",
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": '{"type": "integer"}'}}, "json_schema",
         "structured_outputs.json"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", "structured_outputs.choice"),
        ({"guided_regex": "[0-9]+"}, "regex", "guided_regex"),
        ({"guided_grammar": 'start: "x"+'}, "grammar", "guided_grammar"),
        ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, "grammar",
         "structured_outputs.grammar"),
    ],
)
def test_structured_outputs_are_read(fields: dict[str, Any], kind: str, param: str) -> None:
    for parse, body in ((parse_chat_request, CHAT), (parse_completion_request, COMPLETION)):
        constraint = parse({**body, **fields}).structured
        assert constraint is not None
        assert (constraint.kind, constraint.param) == (kind, param)


@pytest.mark.parametrize(
    ("schema", "param"),
    [
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
         "response_format.json_schema.schema"),
        ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
          "required": ["a"], "additionalProperties": False},
         "response_format.json_schema.schema.required"),
        ({"type": "object", "additionalProperties": False, "required": ["inner"],
          "properties": {"inner": {"anyOf": [{"type": "null"}, {"type": "object"}]}}},
         "response_format.json_schema.schema.properties.inner.anyOf[1]"),
        ({"$defs": {"x": {"type": "object", "properties": {}}}, "$ref": "#/$defs/x"},
         "response_format.json_schema.schema.$defs.x"),
    ],
)
def test_strict_schemas_follow_openais_rules(schema: dict[str, Any], param: str) -> None:
    """strict: true: every object sets additionalProperties: false and requires all its
    properties (OpenAI's structured outputs), else a 400 naming the object; strict: false
    takes the same schema."""
    for strict in (True, False):
        body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": schema, "strict": strict}}}
        if not strict:
            assert parse_chat_request(body).structured is not None
            continue
        with pytest.raises(BadRequestError) as refused:
            parse_chat_request(body)
        assert refused.value.param == param
        assert "strict: true" in refused.value.message


def test_tools_are_read() -> None:
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    request = parse_chat_request({
        **CHAT, "tools": [tool], "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "21 C"},
        ],
    })
    tools = request.tools
    assert [t.name for t in tools.tools] == ["get_weather"]
    assert (tools.choice.mode, tools.choice.function, tools.parallel) == (
        "function", "get_weather", False)
    assert tools.is_active
    assert parse_chat_request({**CHAT, "tools": [tool]}).tools.choice.mode == "auto"
    assert not parse_chat_request({**CHAT, "tools": [tool], "tool_choice": "none"}).tools.is_active


def test_top_p_zero_keeps_only_the_top_token() -> None:
    sampling = parse_chat_request({**CHAT, "top_p": 0}).sampling
    assert (sampling.top_p, sampling.top_k) == (1.0, 1)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("text", ("text",)),
        (["a", "b"], ("a", "b")),
        ([1, 2, 3], ((1, 2, 3),)),
        ([[1], [2, 3]], ((1,), (2, 3))),
    ],
)
def test_completion_prompt_forms(prompt: Any, expected: tuple[Any, ...]) -> None:
    assert parse_completion_request({**COMPLETION, "prompt": prompt}).prompts == expected


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({**CHAT, "temperature": 2.5}, "temperature", None),
        ({**CHAT, "temperature": "hot"}, "temperature", None),
        ({**CHAT, "n": 0}, "n", None),
        ({**CHAT, "n": True}, "n", None),
        ({**CHAT, "max_tokens": 0}, "max_tokens", None),
        ({**CHAT, "top_logprobs": 2}, "top_logprobs", None),
        ({**CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs", None),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ({**CHAT, "stop": 3}, "stop", None),
        ({**CHAT, "messages": []}, "messages", None),
        ({**CHAT, "messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", None),
        ({**CHAT, "messages": [{"role": "user"}]}, "messages[0].content", None),
        ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0].type", "unsupported_parameter"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools[0].function", None),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name", None),
        ({**CHAT, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"description": "x" * 40_000}}}]},
         "tools[0].function.parameters", None),
        ({**CHAT, "tools": [{"type": "function", "function": {
            "name": f"f{i}", "parameters": {"description": "x" * 30_000}}} for i in range(3)]},
         "tools[2].function.parameters", None),
        ({**CHAT, "tool_choice": "required"}, "tool_choice", None),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice.function.name", None),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", None),
        ({**CHAT, "functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({**CHAT, "response_format": {"type": "xml"}}, "response_format.type", None),
        ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format.json_schema.name", None),
        ({**CHAT, "response_format": {"type": "json_object"}, "ignore_eos": True},
         "ignore_eos", None),
        ({**CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}},
         "structured_outputs", None),
        ({**CHAT, "structured_outputs": {"choice": []}}, "structured_outputs.choice", None),
        ({**CHAT, "guided_json": "[" * 5000}, "guided_json", None),
        ({**COMPLETION, "guided_json": "{not json"}, "guided_json", None),
        ({**CHAT, "messages": [{"role": "tool", "content": "x"}]},
         "messages[0].tool_call_id", None),
        ({**CHAT, "messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
         "messages[0].tool_calls[0].function", None),
        ({**CHAT, "logit_bias": {"5": 10}}, "logit_bias", "unsupported_parameter"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", None),
        ({**CHAT, "wat": 1}, "wat", None),
        ({"messages": CHAT["messages"]}, "model", None),
        ({**COMPLETION, "prompt": None}, "prompt", None),
        ({**COMPLETION, "prompt": [1, "a"]}, "prompt", None),
        ({**COMPLETION, "prompt": [[1], [-2]]}, "prompt[1]", None),
        ({**COMPLETION, "logprobs": 6}, "logprobs", None),
        ({**COMPLETION, "echo": True, "logprobs": 1}, "echo", "unsupported_parameter"),
        ({**COMPLETION, "best_of": 3}, "best_of", "unsupported_parameter"),
        ({**COMPLETION, "suffix": "x"}, "suffix", "unsupported_parameter"),
        ({**COMPLETION, "min_tokens": 5, "max_tokens": 2}, "min_tokens", None),
        # Integers no double holds: an OverflowError (a 500) before.
        ({**CHAT, "temperature": 10**400}, "temperature", None),
        ({**CHAT, "top_p": -(10**309)}, "top_p", None),
        ({**COMPLETION, "frequency_penalty": 10**500}, "frequency_penalty", None),
        ({**CHAT, "seed": 10**400}, "seed", None),
        ({**CHAT, "stop_token_ids": list(range(1025))}, "stop_token_ids", None),
        ({**CHAT, "stop_token_ids": ["x"] * 400_000}, "stop_token_ids", None),
        # n x the stop strings' characters: 8 x 3,072 > 16,384.
        ({**CHAT, "n": 8, "stop": ["x" * 1024, "y" * 1024, "z" * 1024]}, "stop", None),
    ],
)
def test_invalid_bodies_name_the_field(body: dict[str, Any], param: str, code: str | None) -> None:
    parse = parse_chat_request if "messages" in body else parse_completion_request
    with pytest.raises(BadRequestError) as raised:
        parse(body)
    assert raised.value.param == param
    assert raised.value.code == code
    assert raised.value.status_code == 400


def test_stop_token_ids_are_kept_once_each_in_order() -> None:
    request = parse_chat_request({**CHAT, "stop_token_ids": [7, 5, 7, 5, 9]})
    assert request.sampling.stop_token_ids == (7, 5, 9)


def test_stop_strings_within_the_bound_pass() -> None:
    # n = 4 x 4,096 characters: exactly the bound.
    request = parse_chat_request({**CHAT, "n": 4, "stop": ["x" * 1024] * 4})
    assert len(request.sampling.stop) == 4


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(BadRequestError):
        parse_chat_request([CHAT])
