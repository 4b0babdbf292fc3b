"""StepOutputs: what one engine step hands back, in columns, from the step to the gateway.

A step of 256 running decodes has 256 outputs, each a handful of the same few kinds of
values. The step appends them to columns (ids, counts, token ids, texts) rather than build an
object per output; the columns cross the pipe out of the engine's process as they are (one
pickle of a few lists), and the caller's side makes a `RequestOutput` of a row only where a
consumer reads one (`output(row)`, `EngineClient`). What most outputs lack (an end,
logprobs, metering, an error) is kept only for the rows that have it.

Neutral: imports only engine.types.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.types import RequestMetrics, RequestOutput, TokenLogprobs

__all__ = ["OutputEnd", "StepOutputs"]


class OutputEnd(NamedTuple):
    """How a sample ended (on its last output)."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    error: str | None = None  # with finish_reason "error"
    error_code: str | None = None  # a RequestErrorCode, with error


@dataclass
class StepOutputs:
    """One step's outputs; row i is one sample's new tokens (and text) since its last output,
    or its end."""

    request_ids: list[str] = field(default_factory=list)  # the caller's request id
    sample_indices: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # how many of token_ids are row i's
    token_ids: list[int] = field(default_factory=list)  # every row's new tokens, in row order
    texts: list[str] = field(default_factory=list)  # detokenized deltas ("" without text)
    num_prompt_tokens: list[int] = field(default_factory=list)
    num_cached_tokens: list[int] = field(default_factory=list)  # served from the prefix cache
    num_output_tokens: list[int] = field(default_factory=list)  # so far, these included
    # The uncommon fields, for the rows that have them.
    ends: dict[int, OutputEnd] = field(default_factory=dict)
    metrics: dict[int, RequestMetrics] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)

    def add(
        self,
        request_id: str,
        sample_index: int,
        new_token_ids: list[int],
        text: str,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        num_output_tokens: int,
        end: OutputEnd | None = None,
        metrics: RequestMetrics | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        row = len(self.request_ids)
        self.request_ids.append(request_id)
        self.sample_indices.append(sample_index)
        self.num_new_tokens.append(len(new_token_ids))
        self.token_ids += new_token_ids
        self.texts.append(text)
        self.num_prompt_tokens.append(num_prompt_tokens)
        self.num_cached_tokens.append(num_cached_tokens)
        self.num_output_tokens.append(num_output_tokens)
        if end is not None:
            self.ends[row] = end
        if metrics is not None:
            self.metrics[row] = metrics
        if logprobs:
            self.logprobs[row] = logprobs

    def extend(self, other: StepOutputs) -> None:
        """other's rows after this one's."""
        offset = len(self.request_ids)
        self.request_ids += other.request_ids
        self.sample_indices += other.sample_indices
        self.num_new_tokens += other.num_new_tokens
        self.token_ids += other.token_ids
        self.texts += other.texts
        self.num_prompt_tokens += other.num_prompt_tokens
        self.num_cached_tokens += other.num_cached_tokens
        self.num_output_tokens += other.num_output_tokens
        self.ends.update((offset + row, end) for row, end in other.ends.items())
        self.metrics.update((offset + row, m) for row, m in other.metrics.items())
        self.logprobs.update((offset + row, lp) for row, lp in other.logprobs.items())

    def __len__(self) -> int:
        return len(self.request_ids)

    def token_starts(self) -> list[int]:
        """Where each row's tokens start in token_ids, and then the end."""
        starts = [0]
        for count in self.num_new_tokens:
            starts.append(starts[-1] + count)
        return starts

    def is_first_token(self, row: int) -> bool:
        """The row carries its sample's first output token."""
        new = self.num_new_tokens[row]
        return new > 0 and self.num_output_tokens[row] == new

    def output(self, row: int, token_start: int) -> RequestOutput:
        """Row `row` as a RequestOutput; its tokens start at token_start (token_starts())."""
        end = self.ends.get(row)
        new = self.num_new_tokens[row]
        return RequestOutput(
            self.request_ids[row],
            self.sample_indices[row],
            self.token_ids[token_start:token_start + new],
            self.texts[row],
            end is not None,
            end.finish_reason if end is not None else None,
            end.stop_reason if end is not None else None,
            self.num_prompt_tokens[row],
            self.num_cached_tokens[row],
            self.num_output_tokens[row],
            self.logprobs.get(row, []),
            end.error if end is not None else None,
            self.metrics.get(row),
            end.error_code if end is not None else None,
        )

    def __iter__(self) -> Iterator[RequestOutput]:
        """Every row as a RequestOutput, in order (for callers in the engine's process: tests,
        benchmarks, offline use)."""
        starts = self.token_starts()
        for row in range(len(self.request_ids)):
            yield self.output(row, starts[row])
