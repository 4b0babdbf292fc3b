"""What the gateway knows about one request once it is over: the message it hands to the
ledger, the metrics and the alert monitor."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import Enum

from gateway.openai.requests import Endpoint


class RequestEnd(Enum):
    """How a request ended (the engine's RequestStatus is where a request is while it runs)."""

    COMPLETED = "completed"  # every choice ended by a stop condition or max_tokens
    ABORTED = "aborted"  # the client went away before the end
    FAILED = "failed"  # the engine failed while running it
    REFUSED = "refused"  # admission said no (429/503): nothing ran


@dataclass(frozen=True)
class RequestRecord:
    """One request, end to end, as the gateway saw it."""

    # The response id the client received (chatcmpl-... / cmpl-...): unique per request.
    request_id: str
    tenant_id: int
    api_key_id: int
    model: str
    tier: str
    endpoint: Endpoint
    status: RequestEnd
    # "stop" / "length" when every choice ended one way; the first other reason otherwise.
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_completion_tokens: int
    # Engine metering over every sample (own compute, and recompute after preemption).
    gpu_seconds: float
    recompute_gpu_seconds: float
    # The tenant whose request preempted this one (pays the recompute); None if none did.
    recompute_charged_tenant_id: int | None
    num_preemptions: int
    # Seconds from arrival at the gateway until the engine first scheduled it.
    queue_time_s: float | None
    # Seconds from arrival at the gateway to the first generated token.
    ttft_s: float | None
    e2e_time_s: float
    # Mean seconds between output tokens after the first, over choices (None: < 2 tokens).
    tpot_s: float | None
    # Gaps between consecutive token-carrying outputs of each choice (inter-token latency).
    inter_token_gaps_s: tuple[float, ...]
    created_at: datetime
    finished_at: datetime
    # The HTTP status the client got (200 for streams that started).
    http_status: int
    # Why admission refused it (rate_limit, budget, shed, ...); None otherwise.
    refusal_reason: str | None = None
    # Seconds spent compiling its structured output's grammar (0: cached or none).
    grammar_compile_s: float = 0.0
    # The LoRA adapter it ran on (its registered name); None: the base model.
    adapter: str | None = None
    # The weights it ran on (the served model's ServedModel.weight_format); None: a refusal,
    # which ran on none.
    weight_format: str | None = None
