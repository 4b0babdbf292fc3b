"""OutputBatch: a step's outputs in columns read back equal, through pickle."""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.output_batch import OutputBatch
from engine.outputs import RequestMetrics, RequestOutput
from engine.runner import TokenLogprobs

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
_output = st.builds(
    RequestOutput,
    request_id=st.text(max_size=8),
    sample_index=st.integers(0, 127),
    new_token_ids=st.lists(st.integers(0, 200_000), max_size=3),
    new_text=st.text(max_size=6),
    finished=st.booleans(),
    finish_reason=st.none() | st.sampled_from(["stop", "length", "abort", "error"]),
    stop_reason=st.none() | st.integers(0, 9) | st.text(max_size=3),
    num_prompt_tokens=st.integers(0, 5000),
    num_cached_tokens=st.integers(0, 5000),
    num_output_tokens=st.integers(0, 5000),
    logprobs=st.lists(_logprobs, max_size=2),
    error=st.none() | st.text(max_size=5),
    metrics=st.none() | _metrics,
    error_code=st.none() | st.sampled_from(["engine_error", "grammar_budget_exceeded"]),
)


@settings(max_examples=200, deadline=None)
@given(outputs=st.lists(_output, max_size=12))
def test_outputs_read_back_equal(outputs: list[RequestOutput]) -> None:
    sent = pickle.loads(pickle.dumps(OutputBatch.encode(outputs)))
    assert sent.decode() == outputs


def test_common_outputs_carry_no_rare_fields() -> None:
    plain = RequestOutput("a", 0, [5], "x", False, None, None, 3, 0, 2)
    last = RequestOutput("a", 0, [6], "y", True, "length", None, 3, 0, 3,
                         metrics=RequestMetrics(arrival_time=1.0))
    batch = OutputBatch.encode([plain, last])
    assert list(batch.rare) == [1] and batch.token_ids == [5, 6]
    assert batch.decode() == [plain, last]
