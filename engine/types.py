"""The engine's shared types: what crosses between its rooms (docs/ARCHITECTURE.md, "The
engine's rooms"). Neutral: imports only the other neutral modules.

- who a request belongs to (`TenantContext`);
- the seam between the engine step and whatever executes the model (`ModelRunner`,
  `RunnerStep`, `ModelRunnerOutput`, `TokenLogprobs`);
- a compiled grammar as the runner sees it (`GrammarTemplate`);
- what the engine hands back per request sample (`RequestOutput`, `RequestMetrics`).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.errors import RequestFault

if TYPE_CHECKING:
    import llguidance

    from engine.output_spec import StructuredOutput
    from engine.scheduler_output import SchedulerOutput


@dataclass
class TenantContext:
    """Who a request belongs to and what the policies granted it."""

    tenant_id: str = "default"
    tier: str = "standard"  # label
    priority: int = 1  # lower is more important
    weight: float = 1.0  # fair-share weight inside the tier
    cache_salt: str = ""  # prefix-cache isolation key
    kv_cap_blocks: int | None = None  # most KV blocks the tenant may hold


@dataclass(frozen=True)
class LoraRequest:
    """A LoRA adapter a request runs with: a PEFT adapter directory (adapter_config.json and
    adapter_model.safetensors). `name` identifies its weights engine-wide (the registry's
    content hash): the runner's caches key on it and it enters the request's prefix-cache
    key, so cached blocks never cross adapters. `pinned`: once loaded, kept in the host
    cache whatever the LRU says (the latest request's word on it holds)."""

    name: str
    path: str
    pinned: bool = False


@dataclass
class TokenLogprobs:
    """Log-probabilities around one sampled token."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability under the (penalised, unscaled-by-temperature) logits
    rank: int  # 1-based rank of the sampled token
    top: list[tuple[int, float]] = field(default_factory=list)  # top-k (token id, logprob)


@dataclass
class ModelRunnerOutput:
    """Result of one step: one new token per chunk that asked to be sampled, in columns:
    row i is the i-th such chunk of the step, in the scheduler's order."""

    request_ids: list[str]
    token_ids: list[int]  # the token sampled for request_ids[i]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # when requested
    # Requests whose grammar matcher failed this step (past its limits, or the library
    # raised): they end with an error rather than go on unconstrained.
    grammar_faults: dict[str, RequestFault] = field(default_factory=dict)
    # Host time each constrained request's matcher took this step (mask and advance): the
    # request's to pay and bounded per request (engine.grammar_budget).
    grammar_seconds: dict[str, float] = field(default_factory=dict)
    # The step's time on the device where the runner measured it (CUDA events); None: the
    # engine times the step on its clock.
    device_time_s: float | None = None

    @property
    def sampled_token_ids(self) -> dict[str, int]:
        """request_id -> its token (for readers that look one up: tests, benchmarks)."""
        return dict(zip(self.request_ids, self.token_ids, strict=True))


class RunnerStep(Protocol):
    """A step the runner has queued; its output may still be on the way."""

    def result(self) -> ModelRunnerOutput:
        """Wait for the step's sampled tokens (and logprobs) on the host. Called once."""
        ...


@dataclass
class FinishedStep:
    """A step whose output was ready when execute returned."""

    output: ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        return self.output


class ModelRunner(Protocol):
    """Executes a scheduled step over the paged KV cache.

    Implementations (on engine.worker.batch_runner.BatchRunner, built from the EngineConfig
    the engine is given): engine.worker.model_runner.TorchModelRunner (real models),
    engine.testing.fake_runner.FakeModelRunner (a test and simulation tool, never a default),
    engine.testing.no_work_runner.NoWorkRunner (a benchmark tool).
    """

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks the runner allocated; the block pool manages exactly this many."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        ...

    @property
    def runs_ahead(self) -> bool:
        """execute returns before the device has finished the step (CUDA): the host can
        schedule the next step meanwhile (async scheduling pays)."""
        ...

    @property
    def weight_format_label(self) -> str:
        """The weights as served, as a short label for usage records and metrics
        (`float32`, `gguf-q4_1`: engine.worker.weight_format)."""
        ...

    def prepare_lora(self, lora: LoraRequest) -> concurrent.futures.Future[float]:
        """Have the adapter ready for requests on it, and hold it there until release_lora:
        read and checked on the host off the step's thread (a done future where it is loaded
        already). The future's result is the FLOPs its update adds per token (metering weighs
        chunks by it); its exception, a ValueError, names why the runner cannot serve it."""
        ...

    def release_lora(self, lora: LoraRequest) -> None:
        """One hold prepare_lora took ends (the adapter may leave host memory once none is
        left)."""
        ...

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerStep:
        """Copy blocks, write the new K/V, run the model, sample; the work may still be in
        flight when it returns. The next execute may come before this step's result(): a
        chunk may then compute a token this step sampled, which the runner still holds (async
        scheduling). Steps run in the order they are given."""
        ...

    def synchronize(self) -> None:
        """Wait until all work the runner queued on its device is done, so that the engine's
        clock read afterwards ends the step's busy time (a no-op on CPU)."""
        ...

    def estimate_flops(
        self, num_new: np.ndarray, num_context: np.ndarray, num_sampled: np.ndarray
    ) -> np.ndarray:
        """Model FLOPs of each chunk: num_new tokens that end at num_context tokens of
        context, with logits for num_sampled of them; int64 arrays in, float64 out (metering
        weighs a step's chunks by it, engine.metering.FlopsEstimator)."""
        ...


class GrammarTemplate(Protocol):
    """A compiled constraint (engine.structured_output): each sample takes its own matcher."""

    @property
    def constraint(self) -> StructuredOutput: ...

    @property
    def closing_ids(self) -> np.ndarray | None:  # a JSON constraint's closing tokens
        ...

    def matcher(self) -> llguidance.LLMatcher: ...



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
