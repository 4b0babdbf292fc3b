"""The usage record: what one request used and cost, written once per request id.

The gateway builds one when a request ends, however it ends, prices it with
``Pricing.price`` and hands it to ``UsageLedger.record`` before the final chunk or ``[DONE]``
goes out. Refusals used nothing but are still worth counting: the gateway folds those of one
key, model and endpoint over a second into one record whose ``num_requests`` says how many
(a flood of 429s costs a row a second, not a row a request).

Recompute after a preemption is a separate line item: the preempted tenant pays nothing for
it; ``recompute_charged_tenant_id`` (the tenant whose request caused the preemption) pays
``recompute_amount_usd_micros``. None there means nobody is charged: the operator absorbs it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

from billing.errors import InvalidRecordError

# Column widths in usage_records; longer values are a caller bug, refused before the database.
MAX_REQUEST_ID_LENGTH = 128
MAX_MODEL_LENGTH = 256
MAX_TIER_LENGTH = 32
MAX_FINISH_REASON_LENGTH = 32
MAX_ADAPTER_LENGTH = 64  # a registered adapter's name (tenants.LoraAdapter.name)
MAX_WEIGHT_FORMAT_LENGTH = 32  # a served model's weight format label ("gguf-q4_1+q8_0")

_COUNT_FIELDS = (
    "num_prompt_tokens",
    "num_cached_prompt_tokens",
    "num_completion_tokens",
    "num_preemptions",
    "amount_usd_micros",
    "recompute_amount_usd_micros",
)
_SECONDS_FIELDS = ("gpu_seconds", "recompute_gpu_seconds", "grammar_compile_s")
_OPTIONAL_SECONDS_FIELDS = ("queue_time_s", "ttft_s", "e2e_time_s")
_TIMESTAMP_FIELDS = ("created_at", "finished_at")
_INT_FIELDS = (
    "tenant_id", "api_key_id", "recompute_charged_tenant_id", "num_requests", *_COUNT_FIELDS
)
_FLOAT_FIELDS = (*_SECONDS_FIELDS, *_OPTIONAL_SECONDS_FIELDS)
_NULLABLE_FIELDS = (
    "adapter",
    "weight_format",
    "api_key_id",
    "finish_reason",
    "recompute_charged_tenant_id",
    *_OPTIONAL_SECONDS_FIELDS,
)


class RecordStatus(enum.StrEnum):
    """How a request ended."""

    COMPLETED = "completed"  # ran to its natural end: EOS, a stop sequence or max_tokens
    STOPPED = "stopped"  # ended early by the server (drain, shutdown) with a partial answer
    ABORTED = "aborted"  # the client disconnected or cancelled
    FAILED = "failed"  # an engine or internal error
    REFUSED = "refused"  # turned away by admission; no tokens were computed


class Endpoint(enum.StrEnum):
    """The OpenAI route that served the request."""

    CHAT_COMPLETIONS = "chat.completions"
    COMPLETIONS = "completions"
    RESPONSES = "responses"


_ENDPOINTS = tuple(e.value for e in Endpoint)


@dataclass(frozen=True)
class UsageRecord:
    """One request's usage, timings and price; the unit the ledger writes exactly once."""

    request_id: str  # unique per request; the ledger's idempotency key
    tenant_id: int  # the tenant that sent the request (and pays its own usage)
    api_key_id: int | None  # the key it authenticated with; None for refusals before auth
    model: str  # the served model name the request asked for
    tier: str  # the tenant's tier when the request arrived (prices depend on it)
    endpoint: str  # an Endpoint value
    status: RecordStatus  # how the request ended
    finish_reason: str | None  # OpenAI finish_reason ("stop", "length", ...) when there is one
    num_prompt_tokens: int  # all prompt tokens, cached ones included (as OpenAI counts them)
    num_cached_prompt_tokens: int  # of those, served from the prefix cache
    num_completion_tokens: int  # generated tokens, summed over the n samples
    gpu_seconds: float  # this request's share of engine step time, recompute excluded
    recompute_gpu_seconds: float  # step time spent recomputing its tokens after preemptions
    recompute_charged_tenant_id: int | None  # who pays that recompute; None: nobody
    num_preemptions: int  # times the engine preempted it
    queue_time_s: float | None  # arrival to first scheduled; None if never scheduled
    ttft_s: float | None  # arrival to first token; None if no token was produced
    e2e_time_s: float | None  # arrival to end; None for refusals
    created_at: datetime  # when the gateway received the request (aware, UTC)
    finished_at: datetime  # when it ended (aware, UTC); decides its day and month
    amount_usd_micros: int  # the tenant's charge for this request (Pricing.price), 1 USD = 10**6
    recompute_amount_usd_micros: int  # the recompute charge, paid by recompute_charged_tenant_id
    # Requests this record stands for: 1, or the refusals folded into it (created_at the first
    # one's arrival, finished_at the last one's).
    num_requests: int = 1
    # Structured output: seconds spent compiling the request's grammar (0 when it came from
    # the cache or there was none); its step time is in gpu_seconds like any other work.
    grammar_compile_s: float = 0.0
    # The LoRA adapter it ran on (its registered name); None: the base model `model`.
    adapter: str | None = None
    # The weights it ran on, as the engine served them: "float32", "bfloat16", "gguf-q4_1"
    # (stored types, the most common first: "gguf-q4_k+q8_0"), "awq-int4", "gptq-int4", "fp8".
    # None: it ran on none (a refusal), or it was recorded before the column existed.
    weight_format: str | None = None

    def __post_init__(self) -> None:
        for name, value, limit in (
            ("request_id", self.request_id, MAX_REQUEST_ID_LENGTH),
            ("model", self.model, MAX_MODEL_LENGTH),
            ("tier", self.tier, MAX_TIER_LENGTH),
        ):
            if not 0 < len(value) <= limit:
                raise InvalidRecordError(f"{name} must have 1 to {limit} characters")
        if self.adapter is not None and not 0 < len(self.adapter) <= MAX_ADAPTER_LENGTH:
            raise InvalidRecordError(f"adapter must have 1 to {MAX_ADAPTER_LENGTH} characters")
        if self.weight_format is not None and not (
                0 < len(self.weight_format) <= MAX_WEIGHT_FORMAT_LENGTH):
            raise InvalidRecordError(
                f"weight_format must have 1 to {MAX_WEIGHT_FORMAT_LENGTH} characters")
        if self.endpoint not in _ENDPOINTS:
            raise InvalidRecordError(f"endpoint must be one of: {', '.join(_ENDPOINTS)}")
        if self.finish_reason is not None and len(self.finish_reason) > MAX_FINISH_REASON_LENGTH:
            raise InvalidRecordError(f"finish_reason is longer than {MAX_FINISH_REASON_LENGTH}")
        for name in _COUNT_FIELDS:
            if getattr(self, name) < 0:
                raise InvalidRecordError(f"{name} must not be negative")
        for name in _SECONDS_FIELDS:
            if not getattr(self, name) >= 0.0:  # also refuses NaN
                raise InvalidRecordError(f"{name} must not be negative")
        for name in _OPTIONAL_SECONDS_FIELDS:
            value = getattr(self, name)
            if value is not None and not value >= 0.0:
                raise InvalidRecordError(f"{name} must not be negative")
        if self.num_requests < 1:
            raise InvalidRecordError("num_requests must be at least 1")
        if self.num_requests > 1 and self.status is not RecordStatus.REFUSED:
            raise InvalidRecordError("only refusals are folded into one record")
        if self.num_cached_prompt_tokens > self.num_prompt_tokens:
            raise InvalidRecordError("num_cached_prompt_tokens exceeds num_prompt_tokens")
        for name in _TIMESTAMP_FIELDS:
            if getattr(self, name).tzinfo is None:
                raise InvalidRecordError(f"{name} must be timezone-aware")

    @property
    def num_tokens(self) -> int:
        """Tokens that count against a monthly token budget: prompt plus completion."""
        return self.num_prompt_tokens + self.num_completion_tokens

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (the spool's line format and the detail export's JSONL)."""
        return record_json({name: getattr(self, name) for name in RECORD_FIELDS})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UsageRecord:
        """The inverse of to_json; raises InvalidRecordError on anything it cannot read."""
        try:
            values = dict(data)
            _check_json_types(values)
            values["status"] = RecordStatus(values["status"])
            for name in _TIMESTAMP_FIELDS:
                values[name] = datetime.fromisoformat(values[name])
            return cls(**values)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRecordError(f"not a usage record: {exc}") from None


def _check_json_types(values: dict[str, Any]) -> None:
    # A spool line that parses but holds the wrong types must be refused here: the database
    # would refuse it at every replay.
    for name, value in values.items():
        if value is None and name in _NULLABLE_FIELDS:
            continue
        if name in _INT_FIELDS:
            is_valid = isinstance(value, int) and not isinstance(value, bool)
        elif name in _FLOAT_FIELDS:
            is_valid = isinstance(value, int | float) and not isinstance(value, bool)
        else:
            is_valid = isinstance(value, str)
        if not is_valid:
            raise TypeError(f"{name} has the wrong type: {value!r}")


# UsageRecord's field names, in order: also the columns of usage_records and of detail exports.
RECORD_FIELDS = tuple(field.name for field in fields(UsageRecord))


def record_json(values: Mapping[Any, Any]) -> dict[str, Any]:
    """The JSON form of a record from its field values (a UsageRecord's or a stored row's)."""
    data = {name: values[name] for name in RECORD_FIELDS}
    data["status"] = RecordStatus(data["status"]).value
    for name in _TIMESTAMP_FIELDS:
        data[name] = data[name].astimezone(UTC).isoformat()
    return data
