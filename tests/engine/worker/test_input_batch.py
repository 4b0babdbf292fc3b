"""InputBatch: kept step by step, it builds the same inputs as building each step from scratch."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sample.sampling_table import SamplingColumns
from engine.sampling_params import SamplingParams
from engine.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput
from engine.worker.input_batch import InputBatch, PendingTokens

BLOCK_SIZE = 4

# Parameters the driver's requests take (each sampling feature, and none).
_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=2**63 + 5),
    SamplingParams(temperature=1.0, min_p=0.1, min_tokens=3, logprobs=2),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=-0.5, seed=-4),
    SamplingParams(frequency_penalty=1.5, logprobs=0, n=2),
]


class _Seq:
    """A request as a from-scratch reference keeps it: all its tokens and its whole table."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.num_computed = 0
        self.table: list[int] = []
        self.params = params


def _from_scratch(chunks: list[ScheduledChunk], seqs: dict[str, _Seq]) -> dict[str, np.ndarray]:
    """The step's inputs built the simple way, token by token (the runner's former method)."""
    input_ids, positions, slots, query_start_loc, context_lens, logits_indices = (
        [], [], [], [0], [], []
    )
    tables = []
    for chunk in chunks:
        seq = seqs[chunk.request_id]
        start, end = chunk.start_pos, chunk.num_context_tokens
        input_ids += seq.tokens[start:end]
        positions += range(start, end)
        bs = BLOCK_SIZE
        slots += [seq.table[p // bs] * bs + p % bs for p in range(start, end)]
        query_start_loc.append(len(input_ids))
        context_lens.append(end)
        if chunk.needs_sample:
            logits_indices.append(len(input_ids) - 1)
        tables.append(seq.table[: -(-end // BLOCK_SIZE)])
    width = max(len(t) for t in tables)
    return {
        "input_ids": np.array(input_ids),
        "positions": np.array(positions),
        "slot_mapping": np.array(slots),
        "block_tables": np.array([t + [0] * (width - len(t)) for t in tables]),
        "query_start_loc": np.array(query_start_loc),
        "context_lens": np.array(context_lens),
        "logits_indices": np.array(logits_indices, dtype=np.int64),
    }


class _Driver:
    """Random requests joining, growing, being preempted and leaving, in every order."""

    def __init__(self, rng: random.Random, batch: InputBatch, ahead: bool = False) -> None:
        """ahead: each step's sampled ids reach the batch only after the next step is built
        (async scheduling), so chunks compute tokens still pending."""
        self.rng = rng
        self.batch = batch
        self.ahead = ahead
        self.in_flight: tuple[PendingTokens, list[int]] | None = None
        self.free_blocks = list(range(1, 400))
        rng.shuffle(self.free_blocks)
        self.seqs: dict[str, _Seq] = {}
        self.held: dict[str, int] = {}  # request id -> table length the batch was sent
        self.removed: set[str] = set()
        self.next_id = 0

    def step(self, num_new: int, num_leave: int, budget: int) -> None:
        rng = self.rng
        for _ in range(num_leave):
            if not self.seqs:
                break
            request_id = rng.choice(sorted(self.seqs))
            seq = self.seqs.pop(request_id)
            self.free_blocks += seq.table
            if self.held.pop(request_id, None) is not None:
                self.removed.add(request_id)
            if rng.random() < 0.5:  # preempted: comes back later with its tokens
                again = _Seq(request_id, seq.tokens, seq.params)
                again.num_prompt = seq.num_prompt
                self.seqs[request_id] = again
        for _ in range(num_new):
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 30))]
            request_id = f"r{self.next_id}"
            self.next_id += 1
            self.seqs[request_id] = _Seq(request_id, prompt, rng.choice(_PARAMS))
        chunks, new_requests, updates = [], [], {}
        for request_id in rng.sample(sorted(self.seqs), len(self.seqs)):
            seq = self.seqs[request_id]
            num = min(len(seq.tokens) - seq.num_computed, budget)
            if num <= 0 or rng.random() < 0.2:
                continue  # out of budget, or not scheduled this step
            budget -= num
            end = seq.num_computed + num
            while len(seq.table) * BLOCK_SIZE < end:
                seq.table.append(self.free_blocks.pop())
            sent = self.held.get(request_id)
            if sent is None:
                new_requests.append(NewRequestData(
                    request_id, list(seq.tokens), seq.num_prompt, list(seq.table),
                    seq.params, None, sample_index=self.next_id % 3,
                ))
            elif rng.random() < 0.1 and seq.table:  # copy-on-write replaces an entry
                index = rng.randrange(len(seq.table))
                self.free_blocks.append(seq.table[index])
                seq.table[index] = self.free_blocks.pop(0)
                first = min(index, sent)
                updates[request_id] = (first, seq.table[first:])
            elif sent < len(seq.table):
                updates[request_id] = (sent, seq.table[sent:])
            self.held[request_id] = len(seq.table)
            chunks.append(ScheduledChunk(request_id, seq.num_computed, num,
                                         end == len(seq.tokens), num > 1))
        if not chunks:
            return
        output = SchedulerOutput(0, chunks, sum(c.num_tokens for c in chunks), new_requests,
                                 updates, [], self.removed)
        self.removed = set()
        batch = self.batch
        batch.update(output)
        got = batch.prepare(chunks)
        expected = _from_scratch(chunks, self.seqs)
        packed = got.to_device(torch.device("cpu"), batch.sampled_on_device, packed=True)
        plain = got.to_device(torch.device("cpu"), batch.sampled_on_device)
        for name, value in expected.items():
            if name != "input_ids":  # the host array lacks the pending ids
                np.testing.assert_array_equal(getattr(got, name), value, err_msg=name)
            np.testing.assert_array_equal(getattr(plain, name).numpy(), value, err_msg=name)
            assert getattr(packed, name).tolist() == getattr(plain, name).tolist(), name
            assert getattr(packed, name).dtype == getattr(plain, name).dtype, name
        states = batch.sample_states(chunks)
        _assert_same_columns(batch.sampling_columns(got.sample_rows),
                             SamplingColumns.of(states))
        sampled = {s.request_id: rng.randrange(3, 1000) for s in states}
        token_ids = [sampled[s.request_id] for s in states]
        pending = batch.mark_sampled(states, torch.tensor(token_ids), got.sample_rows)
        if self.in_flight is not None:
            batch.append_sampled(*self.in_flight)
            self.in_flight = None
        if self.ahead:
            self.in_flight = (pending, token_ids)
        else:
            batch.append_sampled(pending, token_ids)
        for chunk in chunks:
            self.seqs[chunk.request_id].num_computed = chunk.num_context_tokens
        for state in states:
            seq = self.seqs[state.request_id]
            seq.tokens.append(sampled[state.request_id])
        for request_id, seq in self.seqs.items():
            state = batch.requests.get(request_id)
            if state is None:
                continue
            num_pending = int(self.ahead and state in states)
            assert state.num_output_tokens == len(seq.tokens) - seq.num_prompt
            host_tokens = seq.tokens[: len(seq.tokens) - num_pending]
            assert state.prompt_token_ids + state.output_token_ids == host_tokens
            assert batch.token_ids(state.request_id).tolist() == host_tokens


def _assert_same_columns(kept: SamplingColumns, fresh: SamplingColumns) -> None:
    """The batch's kept parameters of the sampled rows equal those read from their states."""
    for name in ("filters", "penalties", "num_logprobs", "min_tokens", "seed_key", "flags",
                 "num_output_tokens"):
        np.testing.assert_array_equal(getattr(kept, name), getattr(fresh, name), err_msg=name)
    assert kept.features == fresh.features


# Steps of (requests joining, requests leaving, token budget).
_STEPS = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3), st.integers(1, 64)),
                  min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), steps=_STEPS)
def test_incremental_inputs_equal_inputs_built_from_scratch(
    seed: int, steps: list[tuple[int, int, int]]
) -> None:
    """Requests join, grow, get a copied block, are preempted and come back, and leave, in
    random orders; a small starting capacity makes the arrays grow on the way."""
    driver = _Driver(random.Random(seed), InputBatch(BLOCK_SIZE, num_rows=2, max_tokens=8))
    for num_new, num_leave, budget in steps:
        driver.step(num_new, num_leave, budget)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), steps=_STEPS)
def test_steps_built_before_the_sampled_ids_arrive_read_them_from_the_device(
    seed: int, steps: list[tuple[int, int, int]]
) -> None:
    """Async scheduling: each step is built before the previous step's ids are on the host.
    Chunks that compute a pending token take its id from the sampled tensor, ids of requests
    dropped meanwhile (preempted, ended) never land in a row reused since, and the inputs
    equal those built from scratch with every token known."""
    driver = _Driver(random.Random(seed), InputBatch(BLOCK_SIZE, num_rows=2, max_tokens=8),
                     ahead=True)
    for num_new, num_leave, budget in steps:
        driver.step(num_new, num_leave, budget)


def test_a_new_request_with_a_held_id_is_a_bug() -> None:
    batch = InputBatch(BLOCK_SIZE)
    data = NewRequestData("a", [5, 6, 7], 3, [1], SamplingParams(), None)
    batch.update(SchedulerOutput(0, [], 0, [data]))
    with pytest.raises(AssertionError, match="held already"):
        batch.update(SchedulerOutput(1, [], 0, [data]))
    # dropped first, the same id may join again (preempted and admitted in one step)
    batch.update(SchedulerOutput(2, [], 0, [data], removed_request_ids={"a"}))
    assert batch.token_ids("a").tolist() == [5, 6, 7] and len(batch) == 1
