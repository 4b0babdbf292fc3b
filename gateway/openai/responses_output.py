"""Response objects and stream events of the Responses API (OpenAI's `response` shape).

A response's output is a list of items: the assistant's message (its text as one
`output_text` part) when it wrote any, then one `function_call` item per tool it called. A
reply cut by max_output_tokens is `incomplete` (reason `max_output_tokens`). The stream is
OpenAI's typed events, each numbered (`sequence_number`): `response.created`,
`response.in_progress`, the message's item and part opened, its text deltas, the part and item
closed, each call's item with its arguments, then `response.completed` (or
`response.incomplete`) with the whole response. A failure ends the stream with an `error`
event instead.

The output is also the next turn's conversation: `conversation_messages` gives it as chat
messages whose tool call ids are the function calls' `call_id`s, so a later request that
answers a call (`function_call_output`) or names this response as previous_response_id
continues the same conversation.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from engine import Tokenizer, TokenLogprobs
from gateway.http.event_stream import sse_event
from gateway.openai.generation import JobSummary
from gateway.openai.responses_request import ResponsesCall
from gateway.openai.tool_calls import ParsedCall


def new_response_id() -> str:
    return f"resp_{secrets.token_hex(16)}"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass
class FunctionCallItem:
    """A tool call of the output, with the ids it keeps across turns."""

    call: ParsedCall
    item_id: str = field(default_factory=lambda: _item_id("fc"))
    call_id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def body(self, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
        return {"id": self.item_id, "type": "function_call", "status": status,
                "call_id": self.call_id, "name": self.call.name,
                "arguments": self.call.arguments if arguments is None else arguments}


@dataclass
class ResponseShell:
    """What every body and event of one response shares, and its output as it is built."""

    call: ResponsesCall
    response_id: str
    model: str
    service_tier: str | None
    tokenizer: Tokenizer
    # Kept in the response store (its `store`, and a retention above 0).
    is_stored: bool
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: _item_id("msg"))
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    calls: list[FunctionCallItem] = field(default_factory=list)

    def body(self, status: str, summary: JobSummary | None = None,
             finish_reason: str | None = None) -> dict[str, Any]:
        """The response object; status "in_progress" while streaming (no output yet)."""
        call = self.call
        request = call.request
        is_done = status in ("completed", "incomplete")
        if is_done and finish_reason == "length":
            status = "incomplete"
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None),
            "instructions": call.instructions,
            "max_output_tokens": call.max_output_tokens,
            "model": self.model,
            "output": self.output_items() if is_done else [],
            "parallel_tool_calls": request.tools.parallel,
            "previous_response_id": call.previous_response_id,
            "reasoning": None,
            "service_tier": self.service_tier,
            "store": self.is_stored,
            "temperature": request.sampling.temperature,
            "text": {"format": call.text_format},
            "tool_choice": call.tool_choice,
            "tools": [_echoed_tool(tool) for tool in call.tools],
            "top_logprobs": call.top_logprobs,
            "top_p": request.sampling.top_p,
            "truncation": "disabled",
            "usage": None if summary is None else usage_body(summary),
            "user": request.user,
            "metadata": call.metadata,
        }

    def output_items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if self.text or not self.calls:
            items.append(self.message_item("completed"))
        items.extend(item.body() for item in self.calls)
        return items

    def message_item(self, status: str, text: str | None = None) -> dict[str, Any]:
        content = [] if text is None and status == "in_progress" else [
            self.text_part(self.text if text is None else text)]
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": content}

    def text_part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": self.logprob_items(self.logprobs)}

    def logprob_items(self, entries: list[TokenLogprobs]) -> list[dict[str, Any]]:
        if not self.call.top_logprobs:
            return []

        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [{**item(e.token_id, e.logprob),
                 "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]

    def set_calls(self, calls: list[ParsedCall]) -> None:
        self.calls = [FunctionCallItem(call) for call in calls]

    def conversation_messages(self) -> list[dict[str, Any]]:
        """This turn (its input and output) as chat messages, for the stored conversation."""
        reply: dict[str, Any] = {"role": "assistant", "content": self.text or None}
        if self.calls:
            reply["tool_calls"] = [
                {"id": item.call_id, "type": "function",
                 "function": {"name": item.call.name, "arguments": item.call.arguments}}
                for item in self.calls
            ]
        elif reply["content"] is None:
            reply["content"] = ""
        return [*self.call.input_messages, reply]


def usage_body(summary: JobSummary) -> dict[str, Any]:
    return {
        "input_tokens": summary.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": summary.num_cached_prompt_tokens},
        "output_tokens": summary.num_completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": summary.num_prompt_tokens + summary.num_completion_tokens,
    }


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": tool.get("name"),
            "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}


class ResponseEvents:
    """The typed events of one streamed response, numbered in order."""

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self._sequence = 0
        self._message_open = False

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(kind, body)

    def start(self) -> list[str]:
        body = self.shell.body("in_progress")
        return [self._event("response.created", response=body),
                self._event("response.in_progress", response=body)]

    def text(self, delta: str, logprobs: list[TokenLogprobs]) -> list[str]:
        """A piece of the message's text (the message opened on its first piece)."""
        if not delta:
            return []
        shell = self.shell
        events = [] if self._message_open else self._open_message()
        shell.text += delta
        shell.logprobs.extend(logprobs)
        events.append(self._event(
            "response.output_text.delta", item_id=shell.message_id, output_index=0,
            content_index=0, delta=delta, logprobs=shell.logprob_items(logprobs)))
        return events

    def _open_message(self) -> list[str]:
        self._message_open = True
        shell = self.shell
        return [
            self._event("response.output_item.added", output_index=0,
                        item=shell.message_item("in_progress")),
            self._event("response.content_part.added", item_id=shell.message_id,
                        output_index=0, content_index=0, part=shell.text_part("")),
        ]

    def finish(self, calls: list[ParsedCall]) -> list[str]:
        """Close the message and add the calls; the caller then sends `done`."""
        shell = self.shell
        shell.set_calls(calls)
        events = []
        if not self._message_open and not calls:
            events += self._open_message()  # an empty reply is still one message
        if self._message_open:
            part = shell.text_part(shell.text)
            events += [
                self._event("response.output_text.done", item_id=shell.message_id,
                            output_index=0, content_index=0, text=shell.text,
                            logprobs=part["logprobs"]),
                self._event("response.content_part.done", item_id=shell.message_id,
                            output_index=0, content_index=0, part=part),
                self._event("response.output_item.done", output_index=0,
                            item=shell.message_item("completed")),
            ]
        first = 1 if self._message_open else 0
        for offset, item in enumerate(shell.calls):
            index = first + offset
            events += [
                self._event("response.output_item.added", output_index=index,
                            item=item.body("in_progress", arguments="")),
                self._event("response.function_call_arguments.delta", item_id=item.item_id,
                            output_index=index, delta=item.call.arguments),
                self._event("response.function_call_arguments.done", item_id=item.item_id,
                            name=item.call.name, output_index=index,
                            arguments=item.call.arguments),
                self._event("response.output_item.done", output_index=index,
                            item=item.body()),
            ]
        return events

    def done(self, body: dict[str, Any]) -> str:
        kind = "response.incomplete" if body["status"] == "incomplete" else (
            "response.completed")
        return self._event(kind, response=body)

    def error(self, error: dict[str, Any]) -> str:
        """An `error` event from an OpenAI error body ({"error": {...}})."""
        detail = error.get("error", error)
        return self._event("error", code=detail.get("code"), message=detail.get("message"),
                           param=detail.get("param"))

