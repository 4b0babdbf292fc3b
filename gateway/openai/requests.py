"""Bodies of POST /v1/chat/completions and /v1/completions, checked against the OpenAI
schema (shared/reference/openai-openapi.yaml) and turned into typed requests.

Every problem raises gateway.http.errors.BadRequestError with ``param`` naming the field.
Fields of the schema that this server cannot honour (audio, the deprecated functions, ...)
are refused with code ``unsupported_parameter`` rather than silently ignored; fields that
only label a request (user, metadata, store, ...) are accepted. Sampling parameters the
engine supports beyond OpenAI's (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens) are accepted too, as vLLM does (the SDK's extra_body).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from engine import (
    MAX_STOP_CHARS_PER_REQUEST,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_TOKEN_IDS,
    StructuredOutput,
)
from gateway.http.errors import BadRequestError
from gateway.openai.structured import (
    NO_TOOLS,
    STRUCTURED_FIELDS,
    ToolRequest,
    check_total_size,
    structured_output,
    tool_request,
)
from policies import REQUEST_SERVICE_TIERS

MAX_N = 128
MAX_STOP_STRINGS = 4
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
_INT64 = 2**63
_FLOAT_RANGE = 2**1024  # integers at or past this do not convert to a double


@dataclass(frozen=True)
class RequestBounds:
    """Operator limits on what one request may ask for, checked before any costly work
    (serve's --max-messages and --max-choices)."""

    max_messages: int = 2048  # messages in one chat request
    max_choices: int = 256  # prompts x n: engine sequences one request may start


class Endpoint(Enum):
    CHAT = "chat.completions"
    COMPLETIONS = "completions"
    RESPONSES = "responses"  # a chat request in the Responses API's words

    @property
    def is_chat(self) -> bool:
        """Whether its requests are conversations (rendered with the chat template)."""
        return self is not Endpoint.COMPLETIONS


@dataclass(frozen=True)
class SamplingFields:
    """Sampling fields common to both endpoints, as the client sent them (validated)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    max_tokens: int | None
    min_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    skip_special_tokens: bool
    # Chat: top_logprobs when logprobs is true; completions: logprobs; None: no logprobs.
    num_logprobs: int | None


@dataclass(frozen=True)
class GenerationRequest:
    """A validated chat or completions request, before tokenization."""

    endpoint: Endpoint
    model: str
    sampling: SamplingFields
    stream: bool
    # stream_options.include_usage: a final chunk with usage and no choices.
    include_usage: bool
    # Chat only: the conversation, each message {"role", "content", ...} with text content.
    messages: tuple[dict[str, Any], ...] = ()
    # Completions only: one entry per prompt, text or token ids.
    prompts: tuple[str | tuple[int, ...], ...] = ()
    # Completions only: the prompt is repeated before the generated text.
    echo: bool = False
    # The OpenAI `user` field (an end-user id of the tenant's), kept for tracing.
    user: str | None = None
    # What the output must match (response_format, structured_outputs, guided_*).
    structured: StructuredOutput | None = None
    # Chat only: the tools offered and tool_choice.
    tools: ToolRequest = NO_TOOLS
    # OpenAI's service_tier (policies.service_tiers); None: not sent (auto).
    service_tier: str | None = None

    def constraints(self) -> list[StructuredOutput]:
        """Every schema and grammar of the request: the structured output, each tool's
        parameters."""
        found = [] if self.structured is None else [self.structured]
        return found + list(self.tools.parameter_constraints)


# Fields that only label or route a request on OpenAI's side: accepted, no effect here.
_IGNORED_CHAT = frozenset(
    {
        "user", "metadata", "store", "safety_identifier", "prompt_cache_key",
        "prompt_cache_retention", "prompt_cache_options", "reasoning_effort", "verbosity",
        "moderation",
    }
)
_IGNORED_COMPLETIONS = frozenset({"user"})
# Engine sampling parameters beyond OpenAI's.
_EXTENSIONS = frozenset(
    {
        "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
        "skip_special_tokens",
    }
)
_COMMON = frozenset(
    {
        "model", "n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
        "max_tokens", "stop", "stream", "stream_options", "logprobs", "logit_bias",
        "service_tier",
    }
)
_CHAT_FIELDS = _COMMON | _EXTENSIONS | _IGNORED_CHAT | STRUCTURED_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "functions", "function_call", "response_format", "audio",
    "modalities", "prediction", "web_search_options",
}
_COMPLETION_FIELDS = _COMMON | _EXTENSIONS | _IGNORED_COMPLETIONS | STRUCTURED_FIELDS | {
    "prompt", "echo", "best_of", "suffix", "response_format",
}
_CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def parse_chat_request(body: object, bounds: RequestBounds | None = None) -> GenerationRequest:
    bounds = bounds or RequestBounds()
    fields = _Fields(body, _CHAT_FIELDS)
    model = fields.string("model", required=True)
    _refuse_chat_features(fields)
    raw_messages = fields.array("messages", required=True)
    if len(raw_messages) > bounds.max_messages:
        raise BadRequestError(
            f"messages holds {len(raw_messages)} messages; this server takes at most "
            f"{bounds.max_messages}",
            param="messages",
        )
    messages = tuple(_message(m, i) for i, m in enumerate(raw_messages))
    if not messages:
        raise BadRequestError("messages must hold at least one message", param="messages")
    logprobs = fields.boolean("logprobs") or False
    top_logprobs = fields.integer("top_logprobs", 0, MAX_CHAT_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise BadRequestError(
            "top_logprobs needs logprobs set to true", param="top_logprobs"
        )
    max_tokens = fields.integer("max_tokens", 1, _INT64 - 1)
    max_completion_tokens = fields.integer("max_completion_tokens", 1, _INT64 - 1)
    if max_completion_tokens is not None:
        max_tokens = max_completion_tokens
    sampling = _sampling(fields, max_tokens, (top_logprobs or 0) if logprobs else None)
    _check_choices(1, sampling.n, bounds)
    stream, include_usage = _stream(fields)
    structured = _structured(fields)
    tools = tool_request(fields.raw("tools"), fields.raw("tool_choice"),
                         fields.raw("parallel_tool_calls"))
    if structured is not None and tools.choice.mode in ("required", "function"):
        raise BadRequestError(
            "a tool_choice that forces a call cannot be combined with a structured output",
            param="tool_choice",
        )
    check_total_size(([structured] if structured else []) + list(tools.parameter_constraints))
    return GenerationRequest(
        endpoint=Endpoint.CHAT,
        model=model,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        messages=messages,
        user=fields.optional_string("user"),
        structured=structured,
        tools=tools,
        service_tier=_service_tier(fields),
    )


def parse_completion_request(
    body: object, bounds: RequestBounds | None = None
) -> GenerationRequest:
    bounds = bounds or RequestBounds()
    fields = _Fields(body, _COMPLETION_FIELDS)
    model = fields.string("model", required=True)
    prompts = _prompts(fields.raw("prompt"), bounds.max_choices)
    suffix = fields.optional_string("suffix")
    if suffix:
        _unsupported("suffix", "suffix (insertion) is not supported by this model")
    echo = fields.boolean("echo") or False
    num_logprobs = fields.integer("logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if echo and num_logprobs is not None:
        _unsupported("echo", "echo together with logprobs (prompt logprobs) is not supported")
    max_tokens = fields.integer("max_tokens", 0, _INT64 - 1)
    if max_tokens == 0:
        raise BadRequestError("max_tokens must be at least 1", param="max_tokens")
    sampling = _sampling(fields, max_tokens, num_logprobs)
    _check_choices(len(prompts), sampling.n, bounds)
    best_of = fields.integer("best_of", 0, 20)
    if best_of is not None and best_of not in (0, sampling.n):
        _unsupported("best_of", "best_of other than n is not supported")
    stream, include_usage = _stream(fields)
    return GenerationRequest(
        endpoint=Endpoint.COMPLETIONS,
        model=model,
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        prompts=prompts,
        echo=echo,
        user=fields.optional_string("user"),
        structured=_structured(fields),
        service_tier=_service_tier(fields),
    )


# -- pieces ------------------------------------------------------------------------------------


def _service_tier(fields: _Fields) -> str | None:
    value = fields.optional_string("service_tier")
    if value is not None and value not in REQUEST_SERVICE_TIERS:
        raise BadRequestError(
            f"service_tier must be one of {', '.join(REQUEST_SERVICE_TIERS)}",
            param="service_tier")
    return value


def _sampling(fields: _Fields, max_tokens: int | None, num_logprobs: int | None) -> SamplingFields:
    top_p = _default(fields.number("top_p", 0.0, 1.0), 1.0)
    top_k = _default(fields.integer("top_k", -1, 2**31 - 1), 0)
    if top_p == 0.0:
        # Nucleus of mass zero: only the most likely token survives.
        top_p, top_k = 1.0, 1
    logit_bias = fields.raw("logit_bias")
    if logit_bias not in (None, {}):
        if not isinstance(logit_bias, dict):
            raise BadRequestError("logit_bias must be an object", param="logit_bias")
        _unsupported("logit_bias", "logit_bias is not supported by this server")
    min_tokens = _default(fields.integer("min_tokens", 0, 2**31 - 1), 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise BadRequestError("min_tokens must not exceed max_tokens", param="min_tokens")
    sampling = SamplingFields(
        n=_default(fields.integer("n", 1, MAX_N), 1),
        temperature=_default(fields.number("temperature", 0.0, 2.0), 1.0),
        top_p=top_p,
        top_k=max(top_k, 0),
        min_p=_default(fields.number("min_p", 0.0, 1.0), 0.0),
        repetition_penalty=_default(
            fields.number("repetition_penalty", 0.0, 100.0, exclusive_minimum=True), 1.0
        ),
        presence_penalty=_default(fields.number("presence_penalty", -2.0, 2.0), 0.0),
        frequency_penalty=_default(fields.number("frequency_penalty", -2.0, 2.0), 0.0),
        seed=fields.integer("seed", -_INT64, _INT64 - 1),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=_stop(fields.raw("stop")),
        stop_token_ids=_stop_token_ids(fields.raw("stop_token_ids")),
        ignore_eos=fields.boolean("ignore_eos") or False,
        skip_special_tokens=_default(fields.boolean("skip_special_tokens"), True),
        num_logprobs=num_logprobs,
    )
    _check_stop_chars(sampling)
    return sampling


def _structured(fields: _Fields) -> StructuredOutput | None:
    constraint = structured_output(
        fields.raw("response_format"), {name: fields.raw(name) for name in STRUCTURED_FIELDS}
    )
    if constraint is not None and fields.boolean("ignore_eos"):
        raise BadRequestError(
            "ignore_eos cannot be combined with a structured output: the grammar ends it",
            param="ignore_eos",
        )
    return constraint


def _stream(fields: _Fields) -> tuple[bool, bool]:
    stream = fields.boolean("stream") or False
    options = fields.raw("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise BadRequestError("stream_options must be an object", param="stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise BadRequestError(
            "stream_options.include_usage must be a boolean", param="stream_options.include_usage"
        )
    if not stream and options:
        raise BadRequestError(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    return stream, bool(include_usage)


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise BadRequestError("stop must be a string or an array of strings", param="stop")
    if len(items) > MAX_STOP_STRINGS:
        raise BadRequestError(
            f"stop holds at most {MAX_STOP_STRINGS} strings", param="stop"
        )
    for index, item in enumerate(items):
        if len(item) > MAX_STOP_STRING_CHARS:
            raise BadRequestError(
                f"a stop string holds at most {MAX_STOP_STRING_CHARS} characters",
                param=f"stop[{index}]" if isinstance(value, list) else "stop",
            )
    # An empty stop string would end every request at once: treated as absent.
    return tuple(s for s in items if s)


def _stop_token_ids(value: object) -> tuple[int, ...]:
    """At most MAX_STOP_TOKEN_IDS, counted before each is read (a 3 MB list of ids is
    refused from its length), without repeats."""
    if isinstance(value, list) and len(value) > MAX_STOP_TOKEN_IDS:
        raise BadRequestError(
            f"stop_token_ids holds {len(value)} ids; this server takes at most "
            f"{MAX_STOP_TOKEN_IDS}",
            param="stop_token_ids",
        )
    return tuple(dict.fromkeys(_int_list(value, "stop_token_ids")))


def _check_stop_chars(sampling: SamplingFields) -> None:
    num_chars = sampling.n * sum(len(stop) for stop in sampling.stop)
    if num_chars > MAX_STOP_CHARS_PER_REQUEST:
        raise BadRequestError(
            f"n={sampling.n} x {num_chars // sampling.n} characters of stop strings is "
            f"{num_chars}; this server takes at most {MAX_STOP_CHARS_PER_REQUEST} (every "
            "sample matches every stop string)",
            param="stop",
        )


def _check_choices(num_prompts: int, n: int, bounds: RequestBounds) -> None:
    if num_prompts * n > bounds.max_choices:
        raise BadRequestError(
            f"{num_prompts} prompt(s) x n={n} asks for {num_prompts * n} choices; this server "
            f"takes at most {bounds.max_choices} in one request",
            param="n" if num_prompts == 1 else "prompt",
        )


def _prompts(value: object, max_prompts: int) -> tuple[str | tuple[int, ...], ...]:
    if value is None:
        raise BadRequestError("prompt is required", param="prompt")
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise BadRequestError(
            "prompt must be a string, an array of strings, an array of token ids or an array "
            "of token id arrays",
            param="prompt",
        )
    if isinstance(value[0], str | list) and len(value) > max_prompts:
        raise BadRequestError(
            f"prompt holds {len(value)} prompts; this server takes at most {max_prompts} "
            "choices (prompts x n) in one request",
            param="prompt",
        )
    if all(isinstance(p, str) for p in value):
        return tuple(value)
    if all(_is_int(t) for t in value):
        return (tuple(value),)
    if all(isinstance(p, list) for p in value):
        return tuple(tuple(_int_list(p, f"prompt[{i}]")) for i, p in enumerate(value))
    raise BadRequestError("prompt mixes strings, token ids and arrays", param="prompt")


def _int_list(value: object, param: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise BadRequestError(f"{param} must be an array of non-negative integers", param=param)
    return list(value)


def _message(value: object, index: int) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not isinstance(value, dict):
        raise BadRequestError("each message must be an object", param=param)
    role = value.get("role")
    if role not in _CHAT_ROLES:
        raise BadRequestError(
            f"role must be one of: {', '.join(sorted(_CHAT_ROLES))}", param=f"{param}.role"
        )
    content = value.get("content")
    if content is None and role not in ("assistant",):
        raise BadRequestError("content is required", param=f"{param}.content")
    if role == "assistant" and value.get("tool_calls") is not None:
        _check_tool_calls(value["tool_calls"], f"{param}.tool_calls")
    elif content is None:
        raise BadRequestError("content is required without tool_calls",
                                  param=f"{param}.content")
    if role == "tool" and not isinstance(value.get("tool_call_id"), str):
        raise BadRequestError("a tool message needs tool_call_id",
                                  param=f"{param}.tool_call_id")
    message = dict(value)
    # Chat templates know system, not OpenAI's newer name for it.
    message["role"] = "system" if role == "developer" else role
    message["content"] = _text_content(content, f"{param}.content")
    return message


def _check_tool_calls(calls: object, param: str) -> None:
    if not isinstance(calls, list):
        raise BadRequestError("tool_calls must be an array", param=param)
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments"), str)):
            raise BadRequestError(
                "each tool call needs function.name and function.arguments (strings)",
                param=f"{param}[{index}].function",
            )


def _text_content(content: object, param: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise BadRequestError("content must be a string or an array of parts", param=param)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise BadRequestError("each content part must be an object", param=f"{param}[{i}]")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequestError("text must be a string", param=f"{param}[{i}].text")
            texts.append(text)
        elif kind == "refusal":
            refusal = part.get("refusal")
            if not isinstance(refusal, str):
                raise BadRequestError(
                    "refusal must be a string", param=f"{param}[{i}].refusal"
                )
            texts.append(refusal)
        else:
            _unsupported(f"{param}[{i}].type", f"content parts of type {kind!r} are not "
                         "supported: this model takes text only")
    return "".join(texts)


def _refuse_chat_features(fields: _Fields) -> None:
    if fields.raw("functions") not in (None, []):
        _unsupported("functions", "functions (deprecated) is not supported: use tools")
    if fields.raw("function_call") not in (None, "none", "auto"):
        _unsupported("function_call", "function_call (deprecated) is not supported: use "
                     "tool_choice")
    modalities = fields.raw("modalities")
    if modalities is not None and modalities != ["text"]:
        _unsupported("modalities", "this model produces text only")
    for name in ("audio", "prediction", "web_search_options"):
        if fields.raw(name) is not None:
            _unsupported(name, f"{name} is not supported by this server")


def _unsupported(param: str, message: str) -> None:
    raise BadRequestError(message, param=param, code="unsupported_parameter")


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Fields:
    """Typed reads of one JSON object; unknown keys are refused as OpenAI does."""

    def __init__(self, body: object, known: frozenset[str]) -> None:
        if not isinstance(body, dict):
            raise BadRequestError("the request body must be a JSON object")
        for key in body:
            if key not in known:
                raise BadRequestError(
                    f"Unrecognized request argument supplied: {key}", param=key
                )
        self._body = body

    def raw(self, name: str) -> Any:
        return self._body.get(name)

    def string(self, name: str, *, required: bool = False) -> str:
        value = self._body.get(name)
        if not isinstance(value, str) or (required and not value):
            raise BadRequestError(f"{name} must be a non-empty string", param=name)
        return value

    def optional_string(self, name: str) -> str | None:
        value = self._body.get(name)
        if value is not None and not isinstance(value, str):
            raise BadRequestError(f"{name} must be a string", param=name)
        return value

    def array(self, name: str, *, required: bool = False) -> list[Any]:
        value = self._body.get(name)
        if value is None and not required:
            return []
        if not isinstance(value, list):
            raise BadRequestError(f"{name} must be an array", param=name)
        return value

    def boolean(self, name: str) -> bool | None:
        return self._typed(name, lambda v: isinstance(v, bool), "a boolean")

    def integer(self, name: str, minimum: int, maximum: int) -> int | None:
        value = self._typed(name, _is_int, "an integer")
        if value is not None and not minimum <= value <= maximum:
            raise BadRequestError(f"{name} must be between {minimum} and {maximum}", param=name)
        return value

    def number(
        self, name: str, minimum: float, maximum: float, *, exclusive_minimum: bool = False
    ) -> float | None:
        value = self._typed(
            name, lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number"
        )
        if value is None:
            return None
        if isinstance(value, int) and not -_FLOAT_RANGE < value < _FLOAT_RANGE:
            # An integer of 309 digits or more: no double holds it (float() would raise).
            raise BadRequestError(f"{name} is out of range", param=name)
        if not math.isfinite(value):
            raise BadRequestError(f"{name} must be a finite number", param=name)
        too_low = value <= minimum if exclusive_minimum else value < minimum
        if too_low or value > maximum:
            low = "(" if exclusive_minimum else "["
            raise BadRequestError(
                f"{name} must be in {low}{minimum:g}, {maximum:g}]", param=name
            )
        return float(value)

    def _typed(self, name: str, check: Callable[[Any], bool], kind: str) -> Any:
        value = self._body.get(name)
        if value is not None and not check(value):
            raise BadRequestError(f"{name} must be {kind}", param=name)
        return value
