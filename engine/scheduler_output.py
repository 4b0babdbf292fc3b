"""What the scheduler hands the model runner for one step.

A request's prompt, sampling parameters and block table go to the runner once, when it joins
the runner's batch (`NewRequestData`: its first admission, or its resumption after a
preemption). Afterwards a step names only what changed: which requests compute how many tokens
from where (`ScheduledChunk`), the block-table entries that changed (`block_updates`), and the
requests the runner must drop (finished or preempted since the previous step). The runner
keeps the rest (engine.input_batch.InputBatch), the tokens it sampled included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.types import GrammarTemplate, LoraRequest


@dataclass(slots=True)
class ScheduledChunk:
    """The tokens one request computes this step (a decode, or a chunk of a prefill): its
    tokens start_pos .. start_pos+num_tokens-1, which the runner already holds."""

    request_id: str
    start_pos: int  # tokens of this request already in the KV cache before this step
    num_tokens: int  # tokens to compute now
    needs_sample: bool  # the chunk ends at the newest token: sample the next one from its logits
    is_prefill: bool  # False only for a single-token decode

    @property
    def num_context_tokens(self) -> int:
        """Tokens attended to by the last token of the chunk (cached prefix + the chunk)."""
        return self.start_pos + self.num_tokens


@dataclass(slots=True)
class NewRequestData:
    """A request joining the runner's batch: everything the runner keeps of it, sent once."""

    request_id: str
    token_ids: list[int]  # prompt, then the outputs so far (a resumed request has some)
    num_prompt_tokens: int
    block_ids: list[int]  # its whole block table
    sampling_params: SamplingParams
    eos_token_id: int | None  # suppressed until min_tokens outputs exist
    sample_index: int = 0  # index among n parallel samples (seeded samples differ by index)
    grammar: GrammarTemplate | None = None  # structured output: the runner's matcher's source
    lora: LoraRequest | None = None  # the adapter it runs with; None: the base model


@dataclass
class SchedulerOutput:
    """One engine step: the batch, in order decodes first, then prefill chunks."""

    step_id: int  # monotonic step counter
    chunks: list[ScheduledChunk]  # what to compute, decodes first
    num_batched_tokens: int  # sum of chunk lengths, never above max_num_batched_tokens
    # Requests the runner does not hold yet (it holds every other chunk's request).
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Held requests whose block table changed: request id -> (first changed index, the table's
    # block ids from that index on). Tables grow at the end; copy-on-write replaces one entry.
    block_updates: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    # Copy-on-write: copy the KV of block src into block dst before running the step.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Requests that ended or were preempted since the previous step: the runner drops what it
    # keeps of them before it takes this step's new requests (a request preempted and admitted
    # again in one step is in both).
    removed_request_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.blocks_to_copy
