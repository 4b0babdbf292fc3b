"""A Responses API body as the chat request it runs as (gateway.openai.responses_request), and
the response it becomes (gateway.openai.responses_output): input items to messages, errors in
the Responses body's words, the stored conversation, the event order."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine import TokenLogprobs
from gateway.http.errors import BadRequestError
from gateway.openai.generation import JobSummary
from gateway.openai.requests import Endpoint, RequestBounds
from gateway.openai.responses_output import ResponseEvents, ResponseShell
from gateway.openai.responses_request import ResponsesCall, parse_responses_request
from gateway.openai.tool_calls import ParsedCall

TOOL = {"type": "function", "name": "get_weather", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}


def _parse(**body: Any) -> ResponsesCall:
    return parse_responses_request({"model": "m", **body})


def _refused(**body: Any) -> BadRequestError:
    with pytest.raises(BadRequestError) as refused:
        _parse(**body)
    return refused.value


def test_a_string_input_with_instructions_is_a_system_and_a_user_message() -> None:
    call = _parse(input="Hi", instructions="Be brief.", max_output_tokens=7, temperature=0.5)
    request = call.request
    assert request.endpoint is Endpoint.RESPONSES
    assert request.messages == ({"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi"})
    assert call.input_messages == ({"role": "user", "content": "Hi"},)
    assert request.sampling.max_tokens == 7 and request.sampling.temperature == 0.5
    assert call.store is True and call.metadata == {}


def test_items_become_the_conversation_with_calls_on_the_assistant_message() -> None:
    call = _parse(input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in "},
                     {"type": "input_text", "text": "Lyon and Nice?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather",
         "arguments": '{"city": "Lyon"}'},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather",
         "arguments": '{"city": "Nice"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "21 C"},
        {"type": "function_call_output", "call_id": "call_b",
         "output": [{"type": "input_text", "text": "24 C"}]},
    ], tools=[TOOL])
    messages = call.request.messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[1]["content"] == "Weather in Lyon and Nice?"
    assert messages[2]["content"] == "Checking."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_a", "call_b"]
    assert messages[4] == {"role": "tool", "tool_call_id": "call_b", "content": "24 C"}
    assert call.request.tools.tools[0].name == "get_weather"


def test_a_continued_call_puts_the_stored_conversation_between_instructions_and_input(
) -> None:
    call = _parse(input="And tomorrow?", instructions="Be brief.",
                  previous_response_id="resp_" + "a" * 32)
    earlier = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sun."}]
    continued = call.continued(earlier, RequestBounds())
    assert [m["content"] for m in continued.request.messages] == [
        "Be brief.", "Weather?", "Sun.", "And tomorrow?"]
    assert continued.input_messages == call.input_messages
    with pytest.raises(BadRequestError) as refused:
        call.continued(earlier, RequestBounds(max_messages=3))
    assert refused.value.param == "previous_response_id"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "n": 2}, "n"),
        ({"input": []}, "input"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": 3}]},
         "input[1].content"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
         "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]},
         "input[0].output"),
        ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]},
         "tools[0].name"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": "hi", "previous_response_id": "chatcmpl-1"}, "previous_response_id"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": "hi", "store": "yes"}, "store"),
    ],
)
def test_errors_name_the_responses_field(body: dict[str, Any], param: str) -> None:
    assert _refused(**body).param == param


def test_schemas_keep_their_responses_params_for_later_errors() -> None:
    call = _parse(input="hi", tools=[TOOL], text={"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "object"}}})
    assert call.request.structured is not None
    assert call.request.structured.param == "text.format.schema"
    [tool_constraint] = call.request.tools.parameter_constraints
    assert tool_constraint.param == "tools[0].parameters"


class _Tokenizer:
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(96 + t) for t in token_ids)


def _shell(call: ResponsesCall) -> ResponseShell:
    return ResponseShell(call, "resp_" + "1" * 32, "m", "default",
                         _Tokenizer(), is_stored=True)  # type: ignore[arg-type]


def _events(lines: list[str]) -> list[dict[str, Any]]:
    events = []
    for line in lines:
        kind, data = line.split("\n")[:2]
        body = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        events.append(body)
    return events


def test_a_streamed_reply_with_text_and_a_call_in_order() -> None:
    call = _parse(input="Weather in Lyon?", tools=[TOOL], top_logprobs=1)
    shell = _shell(call)
    events = ResponseEvents(shell)
    lines = events.start()
    lines += events.text("Let me ", [TokenLogprobs(1, -0.5, 1, [(1, -0.5)])])
    lines += events.text("check.", [])
    lines += events.finish([ParsedCall("get_weather", '{"city": "Lyon"}')])
    body = shell.body("completed", JobSummary(10, 0, 5), "tool_calls")
    lines.append(events.done(body))
    parsed = _events(lines)
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    assert [e["type"] for e in parsed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    assert parsed[4]["logprobs"][0]["token"] == "a"
    message, function_call = body["output"]
    assert message["content"][0]["text"] == "Let me check."
    assert function_call["type"] == "function_call" and parsed[-2]["output_index"] == 1
    assert body["usage"]["total_tokens"] == 15 and body["status"] == "completed"
    # The stored conversation answers the call by the call_id the client saw.
    reply = shell.conversation_messages()[-1]
    assert reply["tool_calls"][0]["id"] == function_call["call_id"]
    assert reply["content"] == "Let me check."


def test_a_reply_cut_by_its_limit_is_incomplete_and_an_empty_one_is_a_message() -> None:
    shell = _shell(_parse(input="hi", max_output_tokens=3))
    events = ResponseEvents(shell)
    events.start()
    kinds = [e["type"] for e in _events(events.finish([]))]
    assert kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    body = shell.body("completed", JobSummary(2, 0, 3), "length")
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["content"][0]["text"] == ""
    assert json.loads(events.done(body).split("\n")[1][6:])["type"] == "response.incomplete"
