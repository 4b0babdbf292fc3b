"""One sequence the engine schedules: its tokens, its tier and tenant, its progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.types import GrammarTemplate, LoraRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks
    RUNNING = "running"  # admitted, holds KV blocks
    PREEMPTED = "preempted"  # blocks freed, back in the waiting queue, keeps its output
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or context length reached
    FINISHED_ABORTED = "finished_aborted"  # client went away or was aborted by the caller
    FINISHED_ERROR = "finished_error"  # a step failed while this request was in it

    @property
    def is_finished(self) -> bool:
        # Asked per request per step. A tuple's `in` tests identity first and hashes nothing
        # (an Enum member's hash runs Python code): cheaper than three `RequestStatus.X`
        # lookups (ops/bench/journal.md, "Block crossings, and what inlining or compiling
        # the hot path would give").
        return self not in _LIVE_STATUSES


_LIVE_STATUSES = (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.PREEMPTED)


@dataclass(eq=False)
class Request:
    """A single sequence. Parallel samples (n > 1) are one Request each, sharing a group id."""

    request_id: str  # unique in the engine; samples are "<group>#<index>" when n > 1
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float  # engine clock seconds; kept across preemptions for ordering
    tenant_id: str = "default"
    tier: str = "standard"  # tier name, used as a label
    priority: int = 1  # lower is more important (premium 0, standard 1, batch 2)
    weight: float = 1.0  # the tenant's fair-share weight
    # Extra key of every block hash (kv_cache.block_hash.prefix_key: the tenant's salt and the
    # adapter): cached blocks are shared by neither tenants nor adapters.
    cache_salt: str = ""
    lora: LoraRequest | None = None  # the adapter it runs with; None: the base model
    lora_flops_per_token: float = 0.0  # what its adapter adds to each token (metering)
    kv_cap_blocks: int | None = None  # most KV blocks this tenant may hold at once
    eos_token_id: int | None = None
    max_tokens: int = 0  # resolved output limit (sampling max_tokens or context room)
    group_id: str = ""  # id shared by the samples of one prompt
    sample_index: int = 0  # index among the group's samples

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    # Tokens sampled by scheduled steps whose ids have not come back yet (at most two under
    # async scheduling: the step in flight and the one being scheduled). They count as the
    # request's tokens for scheduling: its next decode computes the newest of them, whose id
    # only the runner has.
    num_pending_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 before it
    num_preemptions: int = 0
    # Highest num_computed_tokens ever reached; tokens computed again below it are recompute.
    num_computed_high_water: int = 0
    # Tenant whose request caused this one's latest preemption (charged for the recompute).
    preempted_by_tenant_id: str | None = None
    admitted_step: int = -1  # engine step at which it was last admitted (thrash guard)
    admission_seq: int = -1  # monotonic admission counter: "latest admitted" ordering
    first_scheduled_time: float | None = None  # start of the first step that computed for it
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    # Samples 1..n-1 of a group wait until sample 0 has computed the prompt, then fork.
    fork_parent: Request | None = None
    # Metering: this sample's shares of the steps it was in (engine.metering).
    gpu_seconds: float = 0.0  # own compute
    recompute_gpu_seconds: float = 0.0  # tokens computed again after preemptions
    num_recomputed_tokens: int = 0
    # Tenant charged -> recompute seconds (the preemptor at the time of each recompute).
    recompute_gpu_seconds_by_tenant: dict[str, float] = field(default_factory=dict)
    # Structured output: the compiled grammar (set before scheduling) and the compile time
    # the request waited for (charged once, to sample 0 of a group).
    grammar: GrammarTemplate | None = None
    grammar_compile_s: float = 0.0
    # Host time its grammar's masks and advances took so far (charged in gpu_seconds too,
    # bounded by the engine's GrammarBudget).
    grammar_time_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, without building the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def num_uncomputed_tokens(self) -> int:
        return (len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens
                - self.num_computed_tokens)

    @property
    def is_prefill_done(self) -> bool:
        """True once only the newest sampled token is left to compute (decode phase)."""
        # Asked of every running request every step: few property hops.
        num_pending = self.num_pending_tokens
        return (bool(self.output_token_ids) or num_pending > 0) and (
            len(self.prompt_token_ids) + len(self.output_token_ids) + num_pending
            - self.num_computed_tokens <= 1
        )

    def ends_with_pending(self, max_model_len: int) -> bool:
        """Its pending tokens take it to max_tokens or the context length: it ends when they
        come back, and no step computes past them."""
        num_pending = self.num_pending_tokens
        if not num_pending:
            return False
        num_outputs = len(self.output_token_ids) + num_pending  # asked per step: builtins only
        return (num_outputs >= self.max_tokens
                or len(self.prompt_token_ids) + num_outputs >= max_model_len)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def recompute_charged_tenant_id(self) -> str | None:
        """The tenant charged most for this request's recompute; None when there was none."""
        by_tenant = self.recompute_gpu_seconds_by_tenant
        return max(by_tenant, key=by_tenant.__getitem__) if by_tenant else None

    def add_recompute(self, seconds: float, num_tokens: int) -> None:
        """A step's recompute share: it goes to the tenant that caused the preemption."""
        self.num_recomputed_tokens += num_tokens
        self.recompute_gpu_seconds += seconds
        tenant_id = self.preempted_by_tenant_id
        assert tenant_id is not None, "recompute without a preemption"
        by_tenant = self.recompute_gpu_seconds_by_tenant
        by_tenant[tenant_id] = by_tenant.get(tenant_id, 0.0) + seconds
