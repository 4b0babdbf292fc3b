"""What the scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass
class ScheduledChunk:
    """The tokens one request computes this step (a decode, or a chunk of a prefill)."""

    request_id: str
    token_ids: list[int]  # tokens to compute now, at positions start_pos .. start_pos+len-1
    start_pos: int  # tokens of this request already in the KV cache before this step
    block_table: list[int]  # KV block ids covering positions 0 .. start_pos+len-1 (and maybe more)
    needs_sample: bool  # the chunk ends at the newest token: sample the next one from its logits
    is_prefill: bool  # False only for a single-token decode
    # Only read when needs_sample: sampling inputs.
    sampling_params: SamplingParams
    prompt_token_ids: list[int]  # for repetition penalties
    output_token_ids: list[int]  # tokens generated so far (penalties, min_tokens)
    eos_token_id: int | None  # suppressed until min_tokens outputs exist
    sample_index: int = 0  # index among n parallel samples (seeded samples differ by index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_context_tokens(self) -> int:
        """Tokens attended to by the last token of the chunk (cached prefix + the chunk)."""
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One engine step: the batch, in order decodes first, then prefill chunks."""

    step_id: int  # monotonic step counter
    chunks: list[ScheduledChunk]  # what to compute, decodes first
    num_batched_tokens: int  # sum of chunk lengths, never above max_num_batched_tokens
    # Copy-on-write: copy the KV of block src into block dst before running the step.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Requests that ended since the previous step; the runner drops any state it keeps for them.
    finished_request_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.blocks_to_copy
