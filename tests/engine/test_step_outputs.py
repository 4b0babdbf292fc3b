"""StepOutputs: a step's outputs in columns, read back as RequestOutputs equal to what was
added, through pickle (the pipe out of the engine's process) and after extend."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.step_outputs import OutputEnd, StepOutputs
from engine.types import RequestMetrics, RequestOutput, TokenLogprobs

_metrics = st.builds(
    RequestMetrics,
    arrival_time=st.floats(0, 100),
    first_token_time=st.none() | st.floats(0, 100),
    gpu_seconds=st.floats(0, 10),
    recompute_gpu_seconds_by_tenant=st.dictionaries(st.text(max_size=4), st.floats(0, 1),
                                                    max_size=2),
)
_logprobs = st.builds(TokenLogprobs, token_id=st.integers(0, 100), logprob=st.floats(-20, 0),
                      rank=st.integers(1, 100),
                      top=st.lists(st.tuples(st.integers(0, 100), st.floats(-20, 0)), max_size=3))
_end = st.builds(
    OutputEnd,
    finish_reason=st.sampled_from(["stop", "length", "abort", "error"]),
    stop_reason=st.none() | st.integers(0, 9) | st.text(max_size=3),
    error=st.none() | st.text(max_size=5),
    error_code=st.none() | st.sampled_from(["engine_error", "grammar_budget_exceeded"]),
)
_row = st.tuples(
    st.text(max_size=8), st.integers(0, 127), st.lists(st.integers(0, 200_000), max_size=3),
    st.text(max_size=6), st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 5000),
    st.none() | _end, st.none() | _metrics, st.lists(_logprobs, max_size=2),
)


def _expected(row: tuple) -> RequestOutput:  # type: ignore[type-arg]
    (request_id, sample, tokens, text, prompt, cached, num_out, end, metrics, logprobs) = row
    return RequestOutput(
        request_id, sample, tokens, text, end is not None,
        end.finish_reason if end else None, end.stop_reason if end else None,
        prompt, cached, num_out, logprobs, end.error if end else None, metrics,
        end.error_code if end else None,
    )


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(_row, max_size=12), split=st.integers(0, 12))
def test_rows_read_back_equal_through_pickle_and_extend(rows: list[tuple], split: int) -> None:  # type: ignore[type-arg]
    head, tail = StepOutputs(), StepOutputs()
    for index, row in enumerate(rows):
        (head if index < split else tail).add(*row)
    head.extend(tail)
    sent = pickle.loads(pickle.dumps(head))
    assert len(sent) == len(rows)
    assert list(sent) == [_expected(row) for row in rows]


def test_common_rows_carry_no_rare_fields_and_firsts_are_told() -> None:
    outputs = StepOutputs()
    outputs.add("a", 0, [5], "x", 3, 0, 1)
    outputs.add("a", 1, [6], "y", 3, 0, 2)
    outputs.add("b", 0, [], "", 4, 0, 0, OutputEnd("abort"), RequestMetrics(arrival_time=1.0))
    assert outputs.token_ids == [5, 6] and outputs.token_starts() == [0, 1, 2, 2]
    assert list(outputs.ends) == [2] and list(outputs.metrics) == [2] and not outputs.logprobs
    assert [outputs.is_first_token(row) for row in range(3)] == [True, False, False]
    last = outputs.output(2, 2)
    assert last.finished and last.finish_reason == "abort" and last.new_token_ids == []
