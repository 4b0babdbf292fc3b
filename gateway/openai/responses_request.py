"""The body of POST /v1/responses (OpenAI's Responses API), checked and turned into the chat
request it runs as.

A Responses request is a chat request in other words: `instructions` is a system message,
`input` (a string, or a list of items: messages, function calls and their outputs) is the
conversation, `text.format` is `response_format`, function tools are flat instead of nested,
`max_output_tokens` is `max_completion_tokens`. So the body is translated into a chat body
and checked by the chat parser (gateway.openai.requests): one set of rules for sampling,
tools and schemas, and an error names the Responses field it came from (`input[2].content`,
`text.format`, `max_output_tokens`).

What the Responses API adds is kept beside the chat request: `store`, `previous_response_id`
(whose stored conversation the gateway puts before `input` once the body is parsed),
`metadata`, and the fields a response echoes. Features this server cannot honour (built-in
tools, `background`, server-side conversations, prompt templates, images and files in the
input) are refused with `unsupported_parameter`, never ignored.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from engine import StructuredOutput
from gateway.http.errors import BadRequestError
from gateway.openai.metadata import parse_metadata
from gateway.openai.requests import (
    Endpoint,
    GenerationRequest,
    RequestBounds,
    parse_chat_request,
)

# Sampling fields beyond OpenAI's Responses API, as vLLM takes them (the SDK's extra_body).
_EXTENSIONS = frozenset({
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    "skip_special_tokens", "seed", "stop", "presence_penalty", "frequency_penalty",
})
# Passed to the chat parser under the same name.
_SAME = frozenset({
    "model", "temperature", "top_p", "tool_choice", "parallel_tool_calls", "service_tier",
    "user", "stream",
}) | _EXTENSIONS
# Label a request on OpenAI's side: accepted, no effect here.
_IGNORED = frozenset({
    "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
    "include", "reasoning", "max_tool_calls", "moderation",
})
# Refused when set to anything but their off value.
_UNSUPPORTED = {
    "background": "background responses are not supported by this server",
    "conversation": "conversations are not supported by this server; use "
                    "previous_response_id",
    "prompt": "prompt templates are not supported by this server",
    "context_management": "context_management is not supported by this server",
}
_FIELDS = _SAME | _IGNORED | frozenset(_UNSUPPORTED) | {
    "input", "instructions", "previous_response_id", "store", "stream_options", "tools",
    "text", "max_output_tokens", "top_logprobs", "metadata", "truncation",
}
# A chat field's name in a Responses body, for errors the chat parser raises.
_CHAT_TO_RESPONSES = {
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
}
_MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
_RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


@dataclass(frozen=True)
class ResponsesCall:
    """A checked Responses request: the chat request it runs as, and what the Responses API
    keeps and echoes beside it."""

    # endpoint RESPONSES; messages: the instructions, then (once continued) the stored
    # conversation of previous_response_id, then this input.
    request: GenerationRequest
    # This request's input as chat messages (what a stored conversation gains, with the
    # output).
    input_messages: tuple[dict[str, Any], ...]
    instructions: str | None
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str]
    # Echoed in the response as the client sent them (the Responses shapes).
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    max_output_tokens: int | None = None
    top_logprobs: int = 0

    def continued(self, conversation: list[dict[str, Any]], bounds: RequestBounds
                  ) -> ResponsesCall:
        """This call after the stored conversation of its previous_response_id."""
        system = self.request.messages[:1] if self.instructions is not None else ()
        messages = (*system, *conversation, *self.input_messages)
        if len(messages) > bounds.max_messages:
            raise BadRequestError(
                f"the conversation holds {len(messages)} messages with its previous "
                f"responses; this server takes at most {bounds.max_messages}",
                param="previous_response_id",
            )
        return dataclasses.replace(
            self, request=dataclasses.replace(self.request, messages=messages))


def parse_responses_request(body: object, bounds: RequestBounds | None = None) -> ResponsesCall:
    bounds = bounds or RequestBounds()
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    for key in body:
        if key not in _FIELDS:
            raise BadRequestError(f"Unrecognized request argument supplied: {key}", param=key)
    for name, reason in _UNSUPPORTED.items():
        if body.get(name) not in (None, False):
            raise BadRequestError(reason, param=name, code="unsupported_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise BadRequestError('truncation must be "disabled": this server does not drop '
                              "input to fit the context", param="truncation",
                              code="unsupported_parameter")
    instructions = _optional_string(body, "instructions")
    previous = _optional_string(body, "previous_response_id")
    if previous is not None and not _RESPONSE_ID.fullmatch(previous):
        raise BadRequestError(f"previous_response_id {previous!r} is not a response id",
                              param="previous_response_id")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise BadRequestError("store must be a boolean", param="store")
    items = _input_messages(body.get("input"))
    system = [] if instructions is None else [{"role": "system", "content": instructions}]
    chat: dict[str, Any] = {name: body[name] for name in _SAME if name in body}
    chat["messages"] = system + [message for message, _ in items]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = [_chat_tool(tool) for tool in tools]
    if "tool_choice" in body:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    text_format = _text_format(body.get("text"))
    if text_format is not None:
        chat["response_format"] = text_format
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    top_logprobs = body.get("top_logprobs")
    if top_logprobs not in (None, 0):
        chat["logprobs"], chat["top_logprobs"] = True, top_logprobs
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequestError("stream_options must be an object", param="stream_options")
    params = ["instructions"] * len(system) + [param for _, param in items]
    try:
        request = parse_chat_request(chat, bounds)
    except BadRequestError as exc:
        exc.param = _responses_param(exc.param, params)
        raise
    return ResponsesCall(
        request=_in_responses_words(request, params),
        input_messages=request.messages[len(system):],
        instructions=instructions,
        previous_response_id=previous,
        store=store,
        metadata=parse_metadata(body.get("metadata")),
        tools=tools,
        tool_choice=body.get("tool_choice", "auto"),
        text_format=(body.get("text") or {}).get("format") or {"type": "text"},
        max_output_tokens=body.get("max_output_tokens"),
        top_logprobs=top_logprobs or 0,
    )


def _in_responses_words(request: GenerationRequest, message_params: list[str]
                        ) -> GenerationRequest:
    """The chat request as the Responses endpoint's, its schemas' params (which later
    errors name) in the Responses body's words."""
    def renamed(constraint: StructuredOutput) -> StructuredOutput:
        return dataclasses.replace(
            constraint, param=_responses_param(constraint.param, message_params) or "text")

    structured = request.structured
    tools = request.tools
    return dataclasses.replace(
        request,
        endpoint=Endpoint.RESPONSES,
        structured=None if structured is None else renamed(structured),
        tools=dataclasses.replace(tools, parameter_constraints=tuple(
            renamed(c) for c in tools.parameter_constraints)),
    )


def _optional_string(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRequestError(f"{name} must be a string", param=name)
    return value


def _responses_param(param: str | None, message_params: list[str]) -> str | None:
    """A chat parser's param in the Responses body's words."""
    if param is None:
        return None
    match = re.match(r"messages\[(\d+)\](.*)", param)
    if match is not None:
        index = int(match.group(1))
        return message_params[index] if index < len(message_params) else "input"
    if param == "messages":
        return "input"
    if param.startswith("response_format.json_schema"):
        return "text.format" + param[len("response_format.json_schema"):]
    head, dot, rest = param.partition(".")
    if head in _CHAT_TO_RESPONSES:
        return _CHAT_TO_RESPONSES[head] + (dot + rest if rest else "")
    match = re.match(r"(tools\[\d+\])\.function(.*)", param)
    if match is not None:
        return match.group(1) + match.group(2)
    if param.startswith("tool_choice.function"):
        return "tool_choice" + param[len("tool_choice.function"):]
    return param


# -- input -------------------------------------------------------------------------------------


def _input_messages(value: object) -> list[tuple[dict[str, Any], str]]:
    """The input as chat messages, each with the input param it came from."""
    if isinstance(value, str):
        return [({"role": "user", "content": value}, "input")]
    if not isinstance(value, list) or not value:
        raise BadRequestError("input must be a string or a non-empty array of items",
                              param="input")
    messages: list[tuple[dict[str, Any], str]] = []
    for index, item in enumerate(value):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise BadRequestError("each input item must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append((_message(item, param), param))
        elif kind == "function_call":
            _add_call(messages, item, param)
        elif kind == "function_call_output":
            messages.append((_call_output(item, param), param))
        elif kind == "reasoning":
            continue  # a reasoning model's summary: nothing this model reads
        elif kind == "item_reference":
            raise BadRequestError("item references are not supported by this server; send "
                                  "the item itself or use previous_response_id",
                                  param=f"{param}.type", code="unsupported_parameter")
        else:
            raise BadRequestError(f"input items of type {kind!r} are not supported by this "
                                  "server", param=f"{param}.type",
                                  code="unsupported_parameter")
    if not messages:
        raise BadRequestError("input holds no message", param="input")
    return messages


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise BadRequestError(f"role must be one of: {', '.join(sorted(_MESSAGE_ROLES))}",
                              param=f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise BadRequestError("content must be a string or an array of parts",
                              param=f"{param}.content")
    texts = []
    for index, part in enumerate(content):
        part_param = f"{param}.content[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequestError("text must be a string", param=f"{part_param}.text")
            texts.append(text)
        elif kind == "refusal":
            refusal = part.get("refusal")
            if not isinstance(refusal, str):
                raise BadRequestError("refusal must be a string",
                                      param=f"{part_param}.refusal")
            texts.append(refusal)
        elif kind in ("input_image", "input_file", "input_audio"):
            raise BadRequestError(f"{kind} parts are not supported by this model",
                                  param=f"{part_param}.type", code="unsupported_parameter")
        else:
            raise BadRequestError(
                "each content part must be an object with type input_text, output_text or "
                "refusal", param=f"{part_param}.type")
    return {"role": role, "content": "".join(texts)}


def _add_call(messages: list[tuple[dict[str, Any], str]], item: dict[str, Any],
              param: str) -> None:
    """A function call the model made, as a tool call of an assistant message: the one just
    before when it is the assistant's (parallel calls, or text then calls)."""
    name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
    for key, value in (("name", name), ("arguments", arguments), ("call_id", call_id)):
        if not isinstance(value, str) or not value:
            raise BadRequestError(f"a function_call item needs {key} (a non-empty string)",
                                  param=f"{param}.{key}")
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}
    if messages and messages[-1][0]["role"] == "assistant":
        previous = messages[-1][0]
        previous.setdefault("tool_calls", []).append(call)
        if previous.get("content") == "":
            previous["content"] = None
        return
    messages.append(({"role": "assistant", "content": None, "tool_calls": [call]}, param))


def _call_output(item: dict[str, Any], param: str) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise BadRequestError("a function_call_output item needs call_id (a non-empty string)",
                              param=f"{param}.call_id")
    if isinstance(output, list):
        output = _message({"role": "user", "content": output}, param)["content"]
    if not isinstance(output, str):
        raise BadRequestError("output must be a string or an array of text parts",
                              param=f"{param}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


# -- tools and formats -------------------------------------------------------------------------


def _tools(value: object) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadRequestError("tools must be an array", param="tools")
    for index, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise BadRequestError(
                f"only function tools are supported by this server, not {kind!r}",
                param=f"tools[{index}].type",
                code="unsupported_parameter" if isinstance(kind, str) else None)
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise BadRequestError("strict must be a boolean", param=f"tools[{index}].strict")
    return value


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(value: object) -> object:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    if isinstance(value, dict):
        raise BadRequestError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"name": ...}', param="tool_choice", code="unsupported_parameter")
    return value


def _text_format(text: object) -> dict[str, Any] | None:
    """text.format as a chat response_format; None for plain text."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise BadRequestError("text must be an object", param="text")
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise BadRequestError(f"Unrecognized argument: text.{min(unknown)}",
                              param=f"text.{min(unknown)}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise BadRequestError("text.format must be an object", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description")
                  if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise BadRequestError('text.format.type must be "text", "json_object" or "json_schema"',
                          param="text.format.type")
