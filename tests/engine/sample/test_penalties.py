"""PenaltyTable: many penalised requests' counts in one table, counted with one scatter."""

from __future__ import annotations

import gc

import numpy as np
import torch

from engine.sample.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler_output import NewRequestData, SchedulerOutput
from engine.worker.input_batch import InputBatch

VOCAB = 8
_PARAMS = [
    SamplingParams(temperature=0.0, repetition_penalty=1.7, logprobs=VOCAB),
    SamplingParams(temperature=0.0, frequency_penalty=0.9, logprobs=VOCAB),
    SamplingParams(temperature=0.9, seed=11, presence_penalty=1.2, logprobs=VOCAB),
    SamplingParams(temperature=0.0, logprobs=VOCAB),  # not penalised, between the others
]


def _join(batch: InputBatch, request_id: str, params: SamplingParams, prompt: list[int],
          output: list[int]) -> None:
    data = NewRequestData(request_id, prompt + output, len(prompt), [0], params, None)
    batch.update(SchedulerOutput(0, [], 0, [data]))


def test_a_batch_of_penalised_rows_equals_each_row_sampled_alone() -> None:
    """Twelve penalised rows (more than the table's first slots: it grows), several of them
    sampling the same token in one step, over ten steps: each row's tokens and penalised
    logprobs equal those of the same request sampled alone, counted afresh."""
    batch = InputBatch(block_size=16, num_rows=2)
    rng = np.random.default_rng(0)
    num_rows = 16
    for i in range(num_rows):
        prompt = rng.integers(0, VOCAB, size=3).tolist()
        _join(batch, f"r{i}", _PARAMS[i % 4], prompt, rng.integers(0, VOCAB, size=i % 3).tolist())
    sampler = Sampler(VOCAB)
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        states = [batch.requests[f"r{i}"] for i in range(num_rows)]
        rows = np.array([s.row for s in states])
        # Half the rows share one logits row: they sample the same token.
        logits = torch.randn(num_rows, VOCAB, generator=generator)
        logits[::2] = logits[0]
        got = sampler.sample(logits, states, batch.sampling_columns(rows))
        out = got.output()
        for i, state in enumerate(states):
            alone = InputBatch(block_size=16)
            _join(alone, "x", state.sampling_params, state.prompt_token_ids,
                  state.output_token_ids)
            expected = Sampler(VOCAB)(logits[i : i + 1], [alone.requests["x"]])
            assert out.sampled_token_ids[state.request_id] == expected.sampled_token_ids["x"]
            assert out.logprobs[state.request_id].top == expected.logprobs["x"].top
        token_ids = [out.sampled_token_ids[s.request_id] for s in states]
        pending = batch.mark_sampled(states, got.token_ids, rows)
        batch.append_sampled(pending, token_ids)
    table = sampler.penalty_table(torch.device("cpu"))
    assert table.output_counts.shape[0] >= 12
    for state in states:
        counts = state.penalty_counts
        if state.sampling_params.temperature == 0.0 and counts is None:
            continue  # the unpenalised rows have none
        assert counts is not None
        expected_counts = np.bincount(state.output_token_ids, minlength=VOCAB + 1)
        np.testing.assert_array_equal(table.output_counts[counts.slot].numpy(), expected_counts)


def test_a_slot_is_free_again_when_its_request_leaves() -> None:
    batch = InputBatch(block_size=16)
    sampler = Sampler(VOCAB)
    table = sampler.penalty_table(torch.device("cpu"))
    num_free = table.num_free_slots
    for i in range(3):
        _join(batch, f"r{i}", _PARAMS[0], [1, 2], [])
    states = list(batch.requests.values())
    sampler(torch.zeros(3, VOCAB), states)
    assert table.num_free_slots == num_free - 3
    del states
    batch.update(SchedulerOutput(1, [], 0, removed_request_ids={"r0", "r2"}))
    gc.collect()
    assert table.num_free_slots == num_free - 1
    # A new request takes a freed slot, counted afresh: nothing of the old one stays.
    _join(batch, "new", _PARAMS[1], [3], [5, 5])
    state = batch.requests["new"]
    token = sampler(torch.zeros(1, VOCAB), [state]).sampled_token_ids["new"]
    assert state.penalty_counts is not None
    counts = table.output_counts[state.penalty_counts.slot]
    # its outputs and the token it just sampled, counted where it was sampled
    assert counts.tolist() == np.bincount([5, 5, token], minlength=VOCAB + 1).tolist()
