"""What the engine hands back to its caller after each step, per request sample."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.runner import TokenLogprobs


@dataclass
class RequestMetrics:
    """Timings (engine clock seconds) and counters of one sample."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    preempted_by_tenant_id: str | None = None  # the tenant charged for its recompute


@dataclass
class RequestOutput:
    """New tokens (and text) of one sample since the previous output, or its end."""

    request_id: str  # the id the caller passed to add_request
    sample_index: int  # 0..n-1
    new_token_ids: list[int]
    new_text: str  # detokenized delta; "" when the engine has no tokenizer
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    stop_reason: int | str | None  # stop token id or stop string that matched
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int  # output tokens so far, including these
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per new token, if asked
    error: str | None = None  # set when finish_reason == "error"
    metrics: RequestMetrics | None = None
