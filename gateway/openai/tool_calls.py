"""Tool calling: the tools a chat request offers, how the model is told of them, how its calls
are read back out of its text, and the grammar that forces a call.

Models write tool calls in one of a few formats (the `--tool-call-parser` setting, or a guess
from the chat template):
- hermes: each call a JSON object {"name", "arguments"} inside <tool_call>...</tool_call>
  (Qwen 2.5/3, Hermes, and tiergate's own prompt for templates that know no tools);
- llama3_json: {"name", "parameters"} objects, optionally after <|python_tag|>, several
  separated by ";" (Llama 3.1-3.3);
- mistral: [TOOL_CALLS] then a JSON array of {"name", "arguments"} (Mistral v0.3 style).

A template that renders `tools` itself (HF's convention: `tools=` a list of OpenAI tool
objects, assistant `tool_calls` with arguments as objects) is used as it is. One that does
not (the default model's) gets the tools in a system message and past calls and results as
hermes text, so any instruct model can be offered tools.

With tool_choice "required" or a named function the output is constrained by a grammar:
one call (or, with parallel_tool_calls, one or more) whose arguments match the function's
JSON schema, then the end; so the arguments always parse and validate.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engine import JSON_OPTIONS, bounded_numbers

__all__ = [
    "FORMATS",
    "FunctionTool",
    "ParsedCall",
    "StreamedToolCalls",
    "ToolCallFormat",
    "ToolChoice",
    "format_for_template",
    "render_messages",
    "required_call_grammar",
]

ToolFormatName = Literal["hermes", "llama3_json", "mistral"]

# Most calls a forced reply may hold with parallel_tool_calls: a small model forced to call
# may otherwise repeat calls until max_tokens (SmolLM2-135M did, at temperature 1.0).
MAX_PARALLEL_CALLS = 4


@dataclass(frozen=True)
class FunctionTool:
    """A function a chat request offers the model."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None  # a JSON schema of its arguments (an object)

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}

    def call_schema(self, arguments_key: str = "arguments") -> dict[str, Any]:
        """The JSON schema of a call of this function in a format's object."""
        return {
            "type": "object",
            "properties": {
                "name": {"const": self.name},
                arguments_key: bounded_numbers(self.parameters or {"type": "object"}),
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }


@dataclass(frozen=True)
class ToolChoice:
    """tool_choice: "none", "auto", "required", or a named function."""

    mode: Literal["none", "auto", "required", "function"]
    function: str | None = None  # with mode "function"


@dataclass(frozen=True)
class ParsedCall:
    """A call read from the model's text; arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _call(
    data: object, arguments_keys: Sequence[str], names: Collection[str], *,
    needs_arguments: bool = False,
) -> ParsedCall | None:
    """The call data describes: an object naming one of the offered functions (names), with
    its arguments under one of arguments_keys (an object, or JSON text of one); None when it
    is not one. needs_arguments: without the arguments key it is not a call (a reply that
    is plain JSON must not read as a call)."""
    if not isinstance(data, dict) or data.get("name") not in names:
        return None
    for key in arguments_keys:
        if key in data:
            arguments = data[key]
            if isinstance(arguments, str):  # some models write the JSON as a string
                try:
                    arguments = json.loads(arguments)
                except (ValueError, RecursionError):
                    return None
            if not isinstance(arguments, dict):
                return None
            try:
                text = json.dumps(arguments, ensure_ascii=False)
            except RecursionError:  # nested deeper than the encoder recurses: not a call
                return None
            return ParsedCall(data["name"], text)
    return None if needs_arguments else ParsedCall(data["name"], "{}")


class ToolCallFormat:
    """How one family of models writes tool calls."""

    name: ToolFormatName
    marker: str  # text that starts the calls

    def parse(self, text: str, names: Collection[str]) -> tuple[str, list[ParsedCall]]:
        """(the text outside the calls, stripped; the calls) for calls of the offered
        functions (names); no calls: (text, [])."""
        outside, calls = self.split(text, names)
        return (outside.strip(), calls) if calls else (text, [])

    def split(self, text: str, names: Collection[str]) -> tuple[str, list[ParsedCall]]:
        """(the text outside the calls as it stands, the calls); ("", []) without calls.
        Anything that does not read as calls of offered functions is no calls at all."""
        raise NotImplementedError

    def _partition(self, text: str) -> tuple[str, bool, str]:
        """(text before the marker, whether it was there, the calls' part); without the
        marker the whole text may be calls (a special-token marker drops from decoded text,
        a reply of calls alone may have none)."""
        head, found, body = text.partition(self.marker)
        return (head, True, body) if found else ("", False, text)

    def holds_all(self, head: str) -> bool:
        """Whether a reply whose first non-whitespace characters are head (at most the
        marker's length + 1 of them) may be calls from its start, so that nothing of it can
        be streamed as content before the end (a format whose calls may come without their
        marker)."""
        return False

    def grammar(self, tools: Sequence[FunctionTool], parallel: bool) -> str:
        """A Lark grammar (llguidance's) of one call, or one or more with parallel."""
        raise NotImplementedError


def _json_rule(schema: dict[str, Any]) -> str:
    """A Lark rule body for JSON matching schema, written as response_format's JSON is."""
    options = {"x-guidance": JSON_OPTIONS}
    return "%json " + json.dumps({**schema, **options}, separators=(",", ":"))


def _any_call(tools: Sequence[FunctionTool], arguments_key: str) -> dict[str, Any]:
    schemas = [tool.call_schema(arguments_key) for tool in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


class HermesFormat(ToolCallFormat):
    name: ToolFormatName = "hermes"
    marker = "<tool_call>"
    _CLOSE = "</tool_call>"

    def split(self, text: str, names: Collection[str]) -> tuple[str, list[ParsedCall]]:
        # A scan for the tags, each character read at most twice: a regular expression
        # with lazy and greedy whitespace around the body (`<tool_call>\s*(.*?)\s*</...>`)
        # took time cubic in a run of spaces after an opening tag, on the event loop.
        calls: list[ParsedCall] = []
        outside: list[str] = []
        position = 0
        while (start := text.find(self.marker, position)) >= 0:
            body_start = start + len(self.marker)
            end = text.find(self._CLOSE, body_start)
            if end < 0:
                break  # an unclosed call (cut by max_tokens) is left as text
            try:
                call = _call(json.loads(text[body_start:end]), ("arguments", "parameters"),
                             names)
            except (ValueError, RecursionError):
                call = None
            if call is None:
                return "", []
            calls.append(call)
            outside.append(text[position:start])
            position = end + len(self._CLOSE)
        outside.append(text[position:])
        return ("".join(outside), calls) if calls else ("", [])

    def grammar(self, tools: Sequence[FunctionTool], parallel: bool) -> str:
        repeat = f"{{0,{MAX_PARALLEL_CALLS - 1}}}"
        start = f'start: call ("\\n" call){repeat}' if parallel else "start: call"
        return (f'{start}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
                f"body: {_json_rule(_any_call(tools, 'arguments'))}\n")

    @staticmethod
    def render_call(name: str, arguments: object) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"


class Llama3JsonFormat(ToolCallFormat):
    name: ToolFormatName = "llama3_json"
    marker = "<|python_tag|>"

    def split(self, text: str, names: Collection[str]) -> tuple[str, list[ParsedCall]]:
        head, found, body = self._partition(text)
        body = body.strip()
        if not body.startswith("{"):
            return "", []
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(body):
            try:
                data, end = decoder.raw_decode(body, position)
            except (ValueError, RecursionError):
                return "", []
            call = _call(data, ("parameters", "arguments"), names, needs_arguments=not found)
            if call is None:
                return "", []
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \t\n;":
                position += 1
        return head, calls

    def holds_all(self, head: str) -> bool:
        # A reply that opens with a JSON object (or the marker's text) may be a call.
        return not head or head.startswith("{") or self.marker.startswith(head)

    def grammar(self, tools: Sequence[FunctionTool], parallel: bool) -> str:
        repeat = f"{{0,{MAX_PARALLEL_CALLS - 1}}}"
        start = f'start: call ("; " call){repeat}' if parallel else "start: call"
        return f"{start}\ncall: {_json_rule(_any_call(tools, 'parameters'))}\n"


class MistralFormat(ToolCallFormat):
    name: ToolFormatName = "mistral"
    marker = "[TOOL_CALLS]"

    def split(self, text: str, names: Collection[str]) -> tuple[str, list[ParsedCall]]:
        head, found, body = self._partition(text)
        try:
            data = json.loads(body.strip())
        except (ValueError, RecursionError):
            return "", []
        items = data if isinstance(data, list) else [data]
        calls = [_call(item, ("arguments", "parameters"), names, needs_arguments=not found)
                 for item in items]
        if not calls or any(c is None for c in calls):
            return "", []
        return head, [c for c in calls if c is not None]

    def holds_all(self, head: str) -> bool:
        return not head or head.startswith("[")

    def grammar(self, tools: Sequence[FunctionTool], parallel: bool) -> str:
        array = {"type": "array", "items": _any_call(tools, "arguments"), "minItems": 1,
                 "maxItems": MAX_PARALLEL_CALLS if parallel else 1}
        return f"start: {_json_rule(array)}\n"


FORMATS: dict[str, ToolCallFormat] = {
    f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())
}


def template_renders_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def format_for_template(template: str | None, setting: str = "auto") -> ToolCallFormat:
    """The format the model writes calls in: the setting, else a guess from its template
    (hermes for a template that knows no tools: tiergate's own prompt asks for it)."""
    if setting != "auto":
        return FORMATS[setting]
    if not template_renders_tools(template):
        return FORMATS["hermes"]
    assert template is not None
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or "ipython" in template:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


_TOOLS_PROMPT = """\
# Tools

You can call functions to answer. Here they are, one JSON object a line, between <tools> \
and </tools>:
<tools>
{tools}
</tools>

To call one, reply with a JSON object holding its name and arguments between <tool_call> \
and </tool_call>, one such block a call:
<tool_call>
{{"name": "<function name>", "arguments": {{<the arguments>}}}}
</tool_call>"""


def _arguments_object(arguments: object) -> object:
    """An assistant call's arguments as a template expects them: an object when they are
    JSON text holding one (HF's convention), else as given."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def render_messages(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[FunctionTool],
    template: str | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and `tools` argument for the chat template. A template that renders
    tools gets them as they are; for one that does not, the tools go in a system message
    and past calls and their results become hermes text."""
    if template_renders_tools(template):
        rendered = []
        for message in messages:
            message = dict(message)
            if message.get("tool_calls"):
                message["tool_calls"] = [
                    {**call, "function": {
                        **call["function"],
                        "arguments": _arguments_object(call["function"].get("arguments")),
                    }}
                    for call in message["tool_calls"]
                ]
            rendered.append(message)
        return rendered, ([tool.as_openai() for tool in tools] or None)
    rendered = []
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role == "assistant" and message.get("tool_calls"):
            calls = [
                HermesFormat.render_call(call["function"]["name"],
                                         _arguments_object(call["function"].get("arguments")))
                for call in message["tool_calls"]
            ]
            text = "\n".join(([content] if content else []) + calls)
            rendered.append({"role": "assistant", "content": text})
        elif role == "tool":
            rendered.append({"role": "user",
                             "content": f"<tool_response>\n{content or ''}\n</tool_response>"})
        else:
            rendered.append({k: v for k, v in message.items() if k not in ("tool_call_id",)})
    if tools:
        listing = "\n".join(json.dumps(tool.as_openai(), ensure_ascii=False) for tool in tools)
        prompt = _TOOLS_PROMPT.format(tools=listing)
        if rendered and rendered[0]["role"] == "system":
            first = rendered[0]
            rendered[0] = {**first, "content": f"{first.get('content') or ''}\n\n{prompt}"}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def required_call_grammar(
    tool_format: ToolCallFormat,
    tools: Sequence[FunctionTool],
    choice: ToolChoice,
    parallel: bool,
) -> str:
    """The grammar of a reply that must call a tool (tool_choice "required") or the named
    one: its arguments follow the function's schema."""
    if choice.mode == "function":
        tools = [tool for tool in tools if tool.name == choice.function]
        parallel = False
    return tool_format.grammar(tools, parallel)


class StreamedToolCalls:
    """Splits one choice's streamed text into content to send now and calls held for the
    end: text before the format's marker goes out as it comes, the rest waits.

    Linear in the text: each delta is searched for the marker together with the few
    characters before it that could hold the marker's start, never the whole text again."""

    def __init__(self, tool_format: ToolCallFormat, names: Collection[str]) -> None:
        self._format = tool_format
        self._names = names
        self._marker = tool_format.marker
        self._pieces: list[str] = []  # the whole text, as it came
        self._num_chars = 0
        self._unsent: list[str] = []  # the text from _num_sent on, in pieces
        self._num_sent = 0  # characters already sent as content
        self._held_from: int | None = None  # where calls start: nothing from here is sent
        self._head = ""  # the text's first non-whitespace characters (the marker's length + 1)
        self._tail = ""  # the text's last len(marker) - 1 characters

    def feed(self, delta: str) -> str:
        """The content that can be sent now."""
        if not delta:
            return ""
        delta_start = self._num_chars
        self._pieces.append(delta)
        self._num_chars += len(delta)
        if self._held_from is not None:
            return ""
        self._unsent.append(delta)
        marker = self._marker
        window = self._tail + delta
        found = window.find(marker)
        self._tail = window[1 - len(marker):] if len(marker) > 1 else ""
        if len(self._head) <= len(marker):
            self._head = (self._head + delta if self._head else delta.lstrip())[: len(marker) + 1]
        if self._format.holds_all(self._head):
            if found >= 0:
                self._held_from = 0
            return ""
        if found >= 0:
            upto = self._held_from = delta_start - (len(window) - len(delta)) + found
        else:
            upto = self._num_chars - _partial_marker(window, marker)
        return self._send_upto(upto)

    @property
    def num_chars(self) -> int:
        """Characters fed so far."""
        return self._num_chars

    def _send_upto(self, upto: int) -> str:
        if upto <= self._num_sent:
            return ""
        unsent = "".join(self._unsent)
        content, rest = unsent[: upto - self._num_sent], unsent[upto - self._num_sent:]
        self._unsent = [rest] if rest else []
        self._num_sent = upto
        return content

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the end: (the content not sent yet, the calls)."""
        text = "".join(self._pieces)
        outside, calls = self._format.split(text, self._names)
        if not calls:
            return text[self._num_sent:], []
        # What was sent came before the first call: it starts the text outside the calls.
        return outside[self._num_sent:].rstrip(), calls


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of text that begins the marker (and is shorter): it
    waits, for the marker may be completed by the next delta."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[len(text) - size:]):
            return size
    return 0
