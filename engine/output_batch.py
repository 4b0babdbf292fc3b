"""OutputBatch: one step's RequestOutputs in columns, for the pipe out of the engine's process.

A step of 256 running decodes makes 256 RequestOutputs; pickled one object at a time they
cost the engine's process about 0.3 ms a step on a 2-core x86 (a quarter of that step's host
work), and the objects carry the same few kinds of values every time. In columns (lists of
ids, counts, token ids, texts) the same step pickles in about 45 us (ops/bench/README.md).
What most outputs lack (an end, logprobs, metering, an error) goes only for those that have
it. `decode` builds equal RequestOutputs on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import RequestMetrics, RequestOutput
from engine.runner import TokenLogprobs

__all__ = ["OutputBatch"]


@dataclass(frozen=True)
class _Rare:
    """The fields of one output that most outputs leave empty."""

    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[TokenLogprobs]
    error: str | None
    metrics: RequestMetrics | None
    error_code: str | None


@dataclass(frozen=True)
class OutputBatch:
    request_ids: list[str]
    sample_indices: list[int]
    num_new_tokens: list[int]  # per output: how many of token_ids are its
    token_ids: list[int]  # every output's new tokens, in order
    texts: list[str]
    num_prompt_tokens: list[int]
    num_cached_tokens: list[int]
    num_output_tokens: list[int]
    rare: dict[int, _Rare]  # output index -> its uncommon fields

    @classmethod
    def encode(cls, outputs: list[RequestOutput]) -> OutputBatch:
        batch = cls([], [], [], [], [], [], [], [], {})
        token_ids = batch.token_ids
        for index, output in enumerate(outputs):
            batch.request_ids.append(output.request_id)
            batch.sample_indices.append(output.sample_index)
            batch.num_new_tokens.append(len(output.new_token_ids))
            token_ids += output.new_token_ids
            batch.texts.append(output.new_text)
            batch.num_prompt_tokens.append(output.num_prompt_tokens)
            batch.num_cached_tokens.append(output.num_cached_tokens)
            batch.num_output_tokens.append(output.num_output_tokens)
            if (output.finished or output.finish_reason is not None or output.logprobs
                    or output.metrics is not None or output.error is not None
                    or output.stop_reason is not None or output.error_code is not None):
                batch.rare[index] = _Rare(output.finished, output.finish_reason,
                                          output.stop_reason, output.logprobs, output.error,
                                          output.metrics, output.error_code)
        return batch

    def decode(self) -> list[RequestOutput]:
        outputs = []
        start = 0
        common = _Rare(False, None, None, [], None, None, None)
        for index, request_id in enumerate(self.request_ids):
            end = start + self.num_new_tokens[index]
            rare = self.rare.get(index, common)
            outputs.append(RequestOutput(
                request_id=request_id,
                sample_index=self.sample_indices[index],
                new_token_ids=self.token_ids[start:end],
                new_text=self.texts[index],
                finished=rare.finished,
                finish_reason=rare.finish_reason,
                stop_reason=rare.stop_reason,
                num_prompt_tokens=self.num_prompt_tokens[index],
                num_cached_tokens=self.num_cached_tokens[index],
                num_output_tokens=self.num_output_tokens[index],
                logprobs=list(rare.logprobs),
                error=rare.error,
                metrics=rare.metrics,
                error_code=rare.error_code,
            ))
            start = end
        return outputs
