"""GraphInputs: a decode step's inputs in the static buffers graphs read, by one copy.

The CUDA graphs themselves need a GPU; everything they read runs here on the CPU: the byte
layout, the padding rows, the pending ids scattered on the device, and a runner whose decode
steps go through the static buffers (DecodeCudaGraphs with capture off) generating what HF
transformers generates.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedModel

from engine.sampling_params import SamplingParams
from engine.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput
from engine.worker.cuda_graphs import DecodeCudaGraphs
from engine.worker.graph_inputs import GraphInputs
from engine.worker.input_batch import InputBatch, StepInputs
from tests.engine.models.helpers import (
    PagedDriver,
    Sequence,
    hf_greedy,
    make_runner,
    random_prompts,
)

# The seed of this module's `llama` checkpoint (the fixture in tests/engine/conftest.py).
LLAMA_SEED = 5
BLOCK_SIZE = 4
CPU = torch.device("cpu")


def _decode_step(lengths: list[int], seed: int = 0) -> tuple[InputBatch, list[ScheduledChunk]]:
    """A batch holding one request per length (that many tokens), each decoding its last."""
    rng = np.random.default_rng(seed)
    batch = InputBatch(BLOCK_SIZE)
    news = []
    for index, length in enumerate(lengths):
        blocks = rng.permutation(200)[: -(-length // BLOCK_SIZE)].tolist()
        news.append(NewRequestData(f"r{index}", rng.integers(3, 500, length).tolist(), 1,
                                   blocks, SamplingParams(), None))
    batch.update(SchedulerOutput(0, [], 0, news))
    chunks = [ScheduledChunk(f"r{i}", n - 1, 1, True, False) for i, n in enumerate(lengths)]
    return batch, chunks


def _assert_loaded(graph_inputs: GraphInputs, inputs: StepInputs, size: int,
                   sampled: torch.Tensor | None) -> None:
    """Rows :B hold the step's inputs as the plain path gives them, rows B:size padding."""
    static = graph_inputs.batch(size)
    plain = inputs.to_device(CPU, sampled)
    num_seqs, width = plain.block_tables.shape
    for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
        assert getattr(static, name)[:num_seqs].tolist() == getattr(plain, name).tolist(), name
    assert torch.equal(static.block_tables[:num_seqs, :width], plain.block_tables)
    assert static.input_ids[num_seqs:].tolist() == [0] * (size - num_seqs)
    assert static.positions[num_seqs:].tolist() == [0] * (size - num_seqs)
    assert static.slot_mapping[num_seqs:].tolist() == [-1] * (size - num_seqs)  # no KV write
    assert static.context_lens[num_seqs:].tolist() == [1] * (size - num_seqs)
    assert static.block_tables[num_seqs:, 0].tolist() == [0] * (size - num_seqs)
    assert static.query_start_loc.tolist() == list(range(size + 1))
    assert static.logits_indices.tolist() == list(range(size))
    assert static.block_tables.dtype == static.context_lens.dtype == torch.int32
    assert static.input_ids.dtype == static.slot_mapping.dtype == torch.int64


def test_a_step_lands_in_the_static_rows_and_the_rest_is_padding() -> None:
    graph_inputs = GraphInputs(max_num_seqs=8, max_blocks_per_seq=12, device=CPU)
    # a wide step first, then a narrower and shorter one: nothing of the first one shows
    for lengths, size in (([9, 45, 17, 3, 30, 44, 2], 8), ([5, 13, 2], 4), ([1], 1)):
        batch, chunks = _decode_step(lengths, seed=len(lengths))
        inputs = batch.prepare(chunks)
        assert graph_inputs.fits(inputs)
        graph_inputs.load(inputs, size, None)
        _assert_loaded(graph_inputs, inputs, size, None)
    assert graph_inputs.num_loads == 3


def test_pending_ids_come_from_the_sampled_tensor() -> None:
    """Async scheduling: the step is built before the previous step's ids reach the host."""
    graph_inputs = GraphInputs(max_num_seqs=4, max_blocks_per_seq=8, device=CPU)
    batch, chunks = _decode_step([6, 11, 3])
    states = batch.sample_states(chunks)
    sampled = torch.tensor([101, 202, 303])
    batch.mark_sampled(states, sampled, batch.prepare(chunks).sample_rows)
    nxt = [ScheduledChunk(c.request_id, c.start_pos + 1, 1, True, False) for c in chunks]
    inputs = batch.prepare(nxt)
    assert inputs.pending_tokens.tolist() == [0, 1, 2]
    graph_inputs.load(inputs, 4, sampled)
    assert graph_inputs.batch(4).input_ids.tolist() == [101, 202, 303, 0]
    _assert_loaded(graph_inputs, inputs, 4, sampled)


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.lists(st.integers(1, 60), min_size=1, max_size=8),  # context lengths
                  st.integers(0, 8),  # extra padding rows
                  st.floats(0.0, 1.0)),  # share of rows whose newest token is pending
        min_size=1, max_size=6),
    seed=st.integers(0, 1000),
)
def test_random_decode_steps_load_as_the_plain_path_builds_them(
    steps: list[tuple[list[int], int, float]], seed: int
) -> None:
    """Steps of any width, one after another in the same buffers (what an earlier, larger
    step left never shows), some rows computing a token still on the device."""
    graph_inputs = GraphInputs(max_num_seqs=16, max_blocks_per_seq=16, device=CPU)
    rng = np.random.default_rng(seed)
    for lengths, extra, pending_share in steps:
        batch, chunks = _decode_step(lengths, seed=int(rng.integers(1 << 30)))
        states = batch.sample_states(chunks)
        pending = rng.random(len(chunks)) < pending_share
        sampled = None
        if pending.any():  # those rows sampled one more token, its id still on the device
            rows = np.array([s.row for s, p in zip(states, pending, strict=True) if p])
            marked = [s for s, p in zip(states, pending, strict=True) if p]
            sampled = torch.from_numpy(rng.integers(3, 500, len(marked)))
            batch.mark_sampled(marked, sampled, rows)
            chunks = [ScheduledChunk(c.request_id, c.start_pos + int(p), 1, True, False)
                      for c, p in zip(chunks, pending, strict=True)]
        inputs = batch.prepare(chunks)
        assert inputs.pending_tokens.size == int(pending.sum())
        size = min(len(lengths) + extra, 16)
        graph_inputs.load(inputs, size, sampled)
        _assert_loaded(graph_inputs, inputs, size, sampled)


def test_what_does_not_fit_is_left_to_the_plain_path() -> None:
    graph_inputs = GraphInputs(max_num_seqs=2, max_blocks_per_seq=3, device=CPU)
    batch, chunks = _decode_step([5, 6, 7])
    assert not graph_inputs.fits(batch.prepare(chunks))  # three sequences
    prefill = ScheduledChunk("r1", 3, 3, True, True)
    assert not graph_inputs.fits(batch.prepare([chunks[0], prefill]))
    assert not graph_inputs.fits(batch.prepare([
        ScheduledChunk("r0", 3, 1, True, False), ScheduledChunk("r1", 4, 1, False, False)]))
    wide, wide_chunks = _decode_step([13])  # four blocks
    assert not graph_inputs.fits(wide.prepare(wide_chunks))
    assert graph_inputs.fits(batch.prepare(chunks[:2]))
    with pytest.raises(AssertionError, match="does not fit"):
        graph_inputs.load(batch.prepare(chunks), 2, None)


@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "ahead"])
def test_decodes_through_the_static_buffers_generate_what_hf_generates(
    llama: tuple[Path, PreTrainedModel], ahead: bool
) -> None:
    """Five sequences padded to the graph size of 8, then fewer as they end (sizes 4, 2, 1):
    greedy tokens equal HF transformers'; with ahead, decodes read ids still pending."""
    path, hf = llama
    runner = make_runner(path)
    graphs = DecodeCudaGraphs(runner.model, runner.kv_caches, runner.attention,
                              max_num_seqs=8, max_blocks_per_seq=32, capture=False)
    runner.graphs = graphs
    prompts = random_prompts([7, 19, 3, 30, 12], seed=4)
    seqs = [Sequence(f"s{i}", p, 4 + 3 * i) for i, p in enumerate(prompts)]
    PagedDriver(runner, ahead=ahead).run(seqs)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output == hf_greedy(hf, prompt, seq.max_new_tokens), seq.request_id
    # one prefill step, then every step decodes only and goes through the static buffers
    assert graphs.inputs.num_loads == max(s.max_new_tokens for s in seqs) - 1
