"""Response bodies and stream chunks in OpenAI's shapes, for both endpoints.

Chat: ``chat.completion`` / ``chat.completion.chunk``; completions: ``text_completion`` for
both (OpenAI's completions stream uses the same object). Every choice carries ``logprobs``
and ``finish_reason`` keys (null until set), as the spec requires.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from engine import Tokenizer, TokenLogprobs
from gateway.openai.generation import JobSummary
from gateway.openai.requests import Endpoint
from gateway.openai.tool_calls import ToolCallFormat

# Finish reasons the API knows; the engine's "abort" and "error" never reach a client as one.
# "tool_calls" is the gateway's: a choice that stopped after calling tools.
_API_FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}


@dataclass
class ResponseContext:
    """What every chunk and body of one response shares."""

    endpoint: Endpoint
    response_id: str
    created: int
    model: str
    include_usage: bool
    # The OpenAI service_tier of the tier that serves it (policies.service_tiers); None: a
    # tier no service_tier names, left out of the bodies.
    service_tier: str | None = None

    def common(self, kind: str) -> dict[str, Any]:
        """The fields every body and chunk starts with."""
        fields: dict[str, Any] = {"id": self.response_id, "object": kind,
                                  "created": self.created, "model": self.model}
        if self.service_tier is not None:
            fields["service_tier"] = self.service_tier
        return fields


@dataclass
class ChoiceText:
    """Accumulated text and logprobs of one choice (non-streamed responses)."""

    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


def usage_body(summary: JobSummary) -> dict[str, Any]:
    return {
        "prompt_tokens": summary.num_prompt_tokens,
        "completion_tokens": summary.num_completion_tokens,
        "total_tokens": summary.num_prompt_tokens + summary.num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": summary.num_cached_prompt_tokens},
    }


def api_finish_reason(reason: str | None) -> str | None:
    return _API_FINISH_REASONS.get(reason or "")


def full_response(
    context: ResponseContext,
    choices: list[ChoiceText],
    summary: JobSummary,
    tokenizer: Tokenizer,
    tool_format: ToolCallFormat | None = None,
    tool_names: Collection[str] = (),
) -> dict[str, Any]:
    """The body of a non-streamed response. tool_format: the request offered tools (named
    tool_names), and calls of them are read out of each choice's text."""
    if context.endpoint is Endpoint.CHAT:
        body_choices = [
            {
                "index": index,
                **_chat_message(choice, tool_format, tool_names),
                "logprobs": chat_logprobs(choice.logprobs, tokenizer) if choice.logprobs else None,
            }
            for index, choice in enumerate(choices)
        ]
        kind = "chat.completion"
    else:
        body_choices = [
            {
                "index": index,
                "text": choice.text,
                "logprobs": (
                    completion_logprobs(choice.logprobs, tokenizer, 0)
                    if choice.logprobs
                    else None
                ),
                "finish_reason": api_finish_reason(choice.finish_reason),
            }
            for index, choice in enumerate(choices)
        ]
        kind = "text_completion"
    return {**context.common(kind), "choices": body_choices, "usage": usage_body(summary)}


def _chat_message(
    choice: ChoiceText, tool_format: ToolCallFormat | None, tool_names: Collection[str]
) -> dict[str, Any]:
    """A chat choice's message and finish_reason, its tool calls read out of its text."""
    finish_reason = api_finish_reason(choice.finish_reason)
    message: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None}
    if tool_format is not None:
        content, calls = tool_format.parse(choice.text, tool_names)
        if calls:
            message["content"] = content or None
            message["tool_calls"] = [call.as_openai() for call in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
    return {"message": message, "finish_reason": finish_reason}


def chunk(
    context: ResponseContext,
    index: int,
    *,
    text: str,
    role: bool = False,
    logprobs: list[TokenLogprobs] | None = None,
    finish_reason: str | None = None,
    text_offset: int = 0,
    tokenizer: Tokenizer,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One stream chunk for one choice. role=True marks the choice's first chunk (chat);
    tool_calls: the calls the choice ended with (chat, in the delta)."""
    if context.endpoint is Endpoint.CHAT:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {}
        if not role and (text or finish_reason is None):
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": chat_logprobs(logprobs, tokenizer) if logprobs else None,
            "finish_reason": api_finish_reason(finish_reason),
        }
        kind = "chat.completion.chunk"
    else:
        choice = {
            "index": index,
            "text": text,
            "logprobs": (
                completion_logprobs(logprobs, tokenizer, text_offset) if logprobs else None
            ),
            "finish_reason": api_finish_reason(finish_reason),
        }
        kind = "text_completion"
    body: dict[str, Any] = {**context.common(kind), "choices": [choice]}
    if context.include_usage:
        body["usage"] = None
    return body


def usage_chunk(context: ResponseContext, summary: JobSummary) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices."""
    kind = "chat.completion.chunk" if context.endpoint is Endpoint.CHAT else "text_completion"
    return {**context.common(kind), "choices": [], "usage": usage_body(summary)}


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(entries: list[TokenLogprobs], tokenizer: Tokenizer) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {
                **item(entry.token_id, entry.logprob),
                "top_logprobs": [item(token_id, lp) for token_id, lp in entry.top],
            }
            for entry in entries
        ],
        "refusal": None,
    }


def completion_logprobs(
    entries: list[TokenLogprobs], tokenizer: Tokenizer, text_offset: int
) -> dict[str, Any]:
    tokens, offsets = [], []
    for entry in entries:
        text = _token_text(tokenizer, entry.token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [
            {_token_text(tokenizer, token_id): lp for token_id, lp in entry.top}
            for entry in entries
        ],
        "text_offset": offsets,
    }
