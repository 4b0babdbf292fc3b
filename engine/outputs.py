"""What the engine hands back to its caller after each step, per request sample."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.runner import TokenLogprobs


@dataclass
class RequestMetrics:
    """Timings (engine clock seconds), counters and metered GPU time of one sample so far.

    GPU time is this sample's share of the steps it was in (engine.metering): the samples of
    one request add up to the request's total, the shared prompt counted on the sample that
    computed it. Own compute and recompute are disjoint: their sum is all the sample used.
    """

    arrival_time: float
    first_scheduled_time: float | None = None  # start of the first step that computed for it
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    preempted_by_tenant_id: str | None = None  # tenant whose request caused the latest one
    gpu_seconds: float = 0.0  # own compute, charged to the request's tenant
    recompute_gpu_seconds: float = 0.0  # tokens computed again after preemptions
    num_recomputed_tokens: int = 0
    # The tenant charged for the recompute (None when none); with several preemptors, the one
    # charged most: recompute_gpu_seconds_by_tenant has the exact split.
    recompute_charged_tenant_id: str | None = None
    recompute_gpu_seconds_by_tenant: dict[str, float] = field(default_factory=dict)
    # Structured output: the grammar compile time the request waited for (sample 0 carries
    # it; 0.0 when the grammar came from the cache or there is none).
    grammar_compile_s: float = 0.0
    # Host time its grammar's masks and advances took (included in gpu_seconds).
    grammar_time_s: float = 0.0

    @property
    def queue_time_s(self) -> float | None:
        """Arrival to the first step that computed any of its tokens."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        """Arrival to the first output token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_time_s(self) -> float | None:
        """Arrival to the end (finished, aborted or failed)."""
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time


@dataclass(slots=True)
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
    # With the first token, the end, and every llm_engine.METRICS_EVERY_TOKENS tokens between.
    metrics: RequestMetrics | None = None
    # With error: a RequestErrorCode (whether the request caused it, and how).
    error_code: str | None = None
