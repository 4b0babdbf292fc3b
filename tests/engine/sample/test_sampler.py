"""Sampler: greedy, filters, penalties, min_tokens, stateless seeds, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from engine.sample.sampler import Sampler, filtered_probs
from engine.sample.seeded_noise import event_keys, request_key, seeded_exponential
from engine.sampling_params import SamplingParams
from engine.scheduler_output import NewRequestData, SchedulerOutput
from engine.worker.input_batch import InputBatch, RequestState

VOCAB = 8
# Chi-square critical value for 7 degrees of freedom at p = 0.001.
CHI2_CRITICAL_7 = 24.32


def make_chunk(
    request_id: str,
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos_token_id: int | None = None,
    sample_index: int = 0,
    batch: InputBatch | None = None,
) -> RequestState:
    """A request as the runner keeps it (what the sampler reads), in batch (default: a batch
    of its own)."""
    prompt = prompt if prompt is not None else [1, 2]
    output = output if output is not None else []
    data = NewRequestData(
        request_id=request_id,
        token_ids=prompt + output,
        num_prompt_tokens=len(prompt),
        block_ids=[0],
        sampling_params=params,
        eos_token_id=eos_token_id,
        sample_index=sample_index,
    )
    batch = batch if batch is not None else InputBatch(block_size=16, num_rows=1)
    batch.update(SchedulerOutput(0, [], 0, [data]))
    return batch.requests[request_id]


def fixed_logits(num_rows: int = 1) -> torch.Tensor:
    row = torch.tensor([2.0, 1.5, -0.5, 0.3, 1.0, -1.0, 0.0, 0.8])
    return row.repeat(num_rows, 1)


def chi_square(counts: Counter[int], probs: torch.Tensor, num_samples: int) -> float:
    return sum(
        (counts.get(token, 0) - num_samples * p) ** 2 / (num_samples * p)
        for token, p in enumerate(probs.tolist())
        if p > 0
    )


def test_greedy_takes_the_argmax_per_row() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    chunks = [make_chunk(f"r{i}", SamplingParams(temperature=0.0)) for i in range(5)]
    out = Sampler(VOCAB)(logits, chunks)
    assert out.sampled_token_ids == {f"r{i}": int(logits[i].argmax()) for i in range(5)}
    assert out.logprobs == {}


def test_padded_vocab_columns_are_ignored() -> None:
    logits = torch.cat([fixed_logits(), torch.full((1, 4), 100.0)], dim=1)
    out = Sampler(VOCAB)(logits, [make_chunk("r", SamplingParams(temperature=0.0))])
    assert out.sampled_token_ids["r"] == 0


def test_mixed_batch_greedy_rows_ignore_filters_and_random_rows_sample() -> None:
    logits = fixed_logits(3)
    chunks = [
        make_chunk("greedy", SamplingParams(temperature=0.0, top_k=3)),
        make_chunk("topk1", SamplingParams(temperature=1.5, top_k=1)),
        make_chunk("free", SamplingParams(temperature=1.0, seed=3)),
    ]
    out = Sampler(VOCAB, seed=0)(logits, chunks)
    assert out.sampled_token_ids["greedy"] == 0
    assert out.sampled_token_ids["topk1"] == 0
    assert 0 <= out.sampled_token_ids["free"] < VOCAB


def direct_filter(row: list[float], temperature: float, top_k: int, top_p: float,
                  min_p: float) -> list[float]:
    """One row, in plain Python: the definition the vectorised filter must reproduce."""
    scaled = [x / temperature for x in row]
    z = sum(math.exp(x) for x in scaled)
    probs = [math.exp(x) / z for x in scaled]
    keep = [p >= min_p * max(probs) for p in probs]
    order = sorted(range(len(row)), key=lambda i: -scaled[i])
    if top_k:
        for i in order[top_k:]:
            keep[i] = False
    if top_p < 1.0:
        mass = sum(probs[i] for i in order if keep[i])
        before = 0.0
        for i in order:
            if keep[i]:
                if before >= top_p and i != order[0]:
                    keep[i] = False
                before += probs[i] / mass
    total = sum(p for p, k in zip(probs, keep, strict=True) if k)
    return [p / total if k else 0.0 for p, k in zip(probs, keep, strict=True)]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 0, 1.0, 0.0),
        (1.0, 3, 1.0, 0.0),
        (1.0, 0, 0.6, 0.0),
        (1.3, 0, 0.9, 0.0),
        (1.0, 0, 1.0, 0.2),
        (0.8, 5, 0.7, 0.05),
    ],
)
def test_filters_match_direct_computation(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    rows = logits.shape[0]
    probs = filtered_probs(
        logits,
        torch.full((rows,), temperature),
        torch.full((rows,), top_k or VOCAB, dtype=torch.int64),
        torch.full((rows,), top_p),
        torch.full((rows,), min_p),
    )
    for row in range(rows):
        expected = direct_filter(logits[row].tolist(), temperature, top_k, top_p, min_p)
        assert probs[row].tolist() == pytest.approx(expected, abs=1e-6)


def test_filters_apply_per_row() -> None:
    logits = fixed_logits(3)
    probs = filtered_probs(
        logits,
        torch.tensor([1.0, 1.0, 1.0]),
        torch.tensor([2, VOCAB, VOCAB]),
        torch.tensor([1.0, 0.5, 1.0]),
        torch.tensor([0.0, 0.0, 0.5]),
    )
    assert (probs[0] > 0).sum() == 2
    assert probs[1].tolist() == pytest.approx(direct_filter(logits[1].tolist(), 1.0, 0, 0.5, 0.0))
    assert probs[2].tolist() == pytest.approx(direct_filter(logits[2].tolist(), 1.0, 0, 1.0, 0.5))


def sample_counts(sampler: Sampler, params: SamplingParams, num_samples: int) -> Counter[int]:
    logits = fixed_logits(num_samples)
    chunks = [make_chunk(f"r{i}", params) for i in range(num_samples)]
    return Counter(sampler(logits, chunks).sampled_token_ids.values())


def test_unseeded_sampling_follows_the_distribution() -> None:
    num_samples = 4000
    counts = sample_counts(Sampler(VOCAB, seed=0), SamplingParams(temperature=0.8), num_samples)
    expected = torch.softmax(fixed_logits()[0] / 0.8, dim=-1)
    assert chi_square(counts, expected, num_samples) < CHI2_CRITICAL_7


def test_seeded_sampling_follows_the_distribution() -> None:
    num_samples = 4000
    logits = fixed_logits(num_samples)
    chunks = [make_chunk(f"r{i}", SamplingParams(seed=i)) for i in range(num_samples)]
    counts = Counter(Sampler(VOCAB)(logits, chunks).sampled_token_ids.values())
    expected = torch.softmax(fixed_logits()[0], dim=-1)
    assert chi_square(counts, expected, num_samples) < CHI2_CRITICAL_7


def test_top_k_and_top_p_sampling_stay_in_the_kept_set() -> None:
    counts = sample_counts(Sampler(VOCAB, seed=5), SamplingParams(top_k=2), 500)
    assert set(counts) == {0, 1}
    # top_p=0.5: p(0)=0.35 < 0.5, so tokens 0 and 1 are kept, nothing else.
    counts = sample_counts(Sampler(VOCAB, seed=6), SamplingParams(top_p=0.5), 500)
    assert set(counts) == {0, 1}


def generate(sampler: Sampler, params: SamplingParams, num_steps: int,
             companions: int, sample_index: int = 0) -> list[int]:
    """Sample a request step by step, with `companions` other rows before it in each batch."""
    gen = torch.Generator().manual_seed(99)
    base = torch.randn(num_steps, VOCAB, generator=gen)
    output: list[int] = []
    for step in range(num_steps):
        others = [make_chunk(f"o{i}", SamplingParams(temperature=1.0)) for i in range(companions)]
        target = make_chunk("target", params, output=list(output), sample_index=sample_index)
        logits = torch.cat([torch.randn(companions, VOCAB), base[step : step + 1]])
        output.append(sampler(logits, [*others, target]).sampled_token_ids["target"])
    return output


def test_seed_reproducible_across_batch_composition_and_samplers() -> None:
    params = SamplingParams(temperature=1.0, seed=42, top_p=0.95)
    alone = generate(Sampler(VOCAB, seed=0), params, num_steps=12, companions=0)
    crowded = generate(Sampler(VOCAB, seed=7), params, num_steps=12, companions=5)
    assert alone == crowded
    other_sample = generate(Sampler(VOCAB), params, num_steps=12, companions=2, sample_index=1)
    assert other_sample != alone
    other_seed = generate(Sampler(VOCAB), SamplingParams(seed=43, top_p=0.95), 12, companions=0)
    assert other_seed != alone


def test_seed_reproducible_after_preemption() -> None:
    """A resumed request samples step k from (seed, index, k): no state was lost with it."""
    params = SamplingParams(seed=7)
    logits = fixed_logits()
    first = Sampler(VOCAB)(logits, [make_chunk("a", params, output=[3, 1, 4])])
    resumed = Sampler(VOCAB)(logits, [make_chunk("a", params, prompt=[1, 2], output=[3, 1, 4])])
    assert first.sampled_token_ids == resumed.sampled_token_ids


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """splitmix64's finaliser on Python ints (the reference for the numpy one)."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)


def reference_key(seed: int, sample_index: int, num_output_tokens: int) -> int:
    """The key of one seeded sampling event, in Python ints, as an int64."""
    key = _mix64((seed + 0x9E3779B97F4A7C15) & _MASK64)
    key = _mix64(((key ^ sample_index) + 0x9E3779B97F4A7C15) & _MASK64)
    key = _mix64(((key ^ num_output_tokens) + 0x9E3779B97F4A7C15) & _MASK64)
    return key - (1 << 64) if key >= 1 << 63 else key


def test_keys_equal_the_python_reference() -> None:
    """A request's key (once, Python ints), then each event's (numpy uint64, wrapping, the
    whole batch at once), bit for bit the reference's, over seeds from both ends of the int64
    range and beyond (a seed is taken modulo 2**64)."""
    seeds = [0, 1, 5, 42, 2**31, 2**63 - 1, -1, -(2**63), 123456789123, 2**64 + 7]
    cases = [(seed, index, num) for seed in seeds for index in (0, 1, 127)
             for num in (0, 1, 4095, 10**6)]
    got = event_keys(
        np.array([request_key(seed, index) for seed, index, _ in cases], dtype=np.int64),
        np.array([num for _, _, num in cases], dtype=np.int64),
    )
    assert got.dtype == np.int64
    assert got.tolist() == [reference_key(*case) for case in cases]


def test_seeded_noise_is_the_splitmix64_stream() -> None:
    key = reference_key(5, 0, 0)
    noise = seeded_exponential(torch.tensor([key]), 4)[0]
    state = key & _MASK64
    for v in range(4):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        uniform = ((z >> 40) + 0.5) / (1 << 24)
        assert noise[v].item() == pytest.approx(-math.log(uniform), rel=1e-6)
    assert reference_key(5, 0, 1) != key and reference_key(5, 1, 0) != key


def logprobs_of(chunk: RequestState, logits: torch.Tensor, mode: str = "penalized") -> float:
    sampler = Sampler(VOCAB, logprobs_mode=mode)  # type: ignore[arg-type]
    out = sampler(logits, [chunk])
    return out.logprobs[chunk.request_id].logprob


def test_repetition_penalty_matches_hf() -> None:
    logits = fixed_logits()
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=VOCAB)
    chunk = make_chunk("r", params, prompt=[0, 2], output=[2, 4])
    out = Sampler(VOCAB)(logits, [chunk])
    expected = logits[0].clone()
    expected[0] = 2.0 / 2  # positive: divided
    expected[2] = -0.5 * 2  # negative: multiplied (once, although it occurs twice)
    expected[4] = 1.0 / 2
    top = dict(out.logprobs["r"].top)
    for token, value in enumerate(torch.log_softmax(expected, dim=-1).tolist()):
        assert top[token] == pytest.approx(value, abs=1e-6)
    assert out.sampled_token_ids["r"] == 1  # 1.5 is now the largest logit


def test_frequency_and_presence_penalties_match_openai() -> None:
    logits = fixed_logits()
    params = SamplingParams(
        temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25, logprobs=VOCAB
    )
    # Prompt tokens do not count for OpenAI penalties; output token 0 occurs 3 times, 7 once.
    chunk = make_chunk("r", params, prompt=[1, 1, 1], output=[0, 0, 7, 0])
    out = Sampler(VOCAB)(logits, [chunk])
    expected = logits[0].clone()
    expected[0] -= 3 * 0.5 + 0.25
    expected[7] -= 1 * 0.5 + 0.25
    top = dict(out.logprobs["r"].top)
    for token, value in enumerate(torch.log_softmax(expected, dim=-1).tolist()):
        assert top[token] == pytest.approx(value, abs=1e-6)
    assert out.sampled_token_ids["r"] == 1


def test_penalty_counts_kept_between_steps_equal_a_full_recount() -> None:
    """A request's counts are made once and then take each token sampled (on the sampling
    device, before its id is on the host); the penalised logprobs each step equal those of a
    request seen for the first time."""
    params = SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.5,
                            frequency_penalty=0.5, presence_penalty=0.25, logprobs=VOCAB)
    batch = InputBatch(block_size=16)  # the runner's batch the state reads its tokens from
    kept = make_chunk("r", params, prompt=[1, 2, 2], output=[VOCAB + 1], batch=batch)
    sampler = Sampler(VOCAB)
    rng = torch.Generator().manual_seed(0)
    for _ in range(12):
        logits = torch.randn(1, VOCAB, generator=rng)
        fresh = make_chunk("r", params, prompt=[1, 2, 2], output=list(kept.output_token_ids))
        got = sampler(logits, [kept])
        expected = Sampler(VOCAB)(logits, [fresh])
        assert got.sampled_token_ids == expected.sampled_token_ids
        assert got.logprobs["r"].top == expected.logprobs["r"].top
        assert kept.penalty_counts is not None
        token = got.sampled_token_ids["r"]
        pending = batch.mark_sampled([kept], torch.tensor([token]), np.array([kept.row]))
        counts = kept.penalty_counts
        assert counts.num_counted == kept.num_output_tokens  # the pending one too
        assert counts.table.output_counts[counts.slot, token] == (
            list(kept.output_token_ids).count(token) + 1
        )
        batch.append_sampled(pending, [token])  # the id on the host, later


def test_penalties_ignore_token_ids_outside_the_logits() -> None:
    logits = fixed_logits()
    params = SamplingParams(temperature=0.0, repetition_penalty=4.0, logprobs=0)
    out = Sampler(VOCAB)(logits, [make_chunk("r", params, prompt=[0, VOCAB + 3], output=[0])])
    assert out.sampled_token_ids["r"] == 1  # only token 0 was penalised (2.0 -> 0.5)


def test_penalties_touch_only_their_rows() -> None:
    logits = fixed_logits(2)
    chunks = [
        make_chunk("plain", SamplingParams(temperature=0.0, logprobs=0), output=[0, 0]),
        make_chunk("penal", SamplingParams(temperature=0.0, frequency_penalty=2.0), output=[0]),
    ]
    out = Sampler(VOCAB)(logits, chunks)
    assert out.sampled_token_ids == {"plain": 0, "penal": 1}
    assert out.logprobs["plain"].logprob == pytest.approx(
        torch.log_softmax(logits[0], dim=-1)[0].item()
    )


def test_raw_logprobs_mode_reads_logits_before_penalties() -> None:
    logits = fixed_logits()
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=0)
    raw = torch.log_softmax(logits[0], dim=-1)
    # a request each: sampling one counts its token for its penalties
    assert logprobs_of(make_chunk("r", params, output=[0]), logits, "raw") == pytest.approx(
        raw[1].item()
    )
    assert logprobs_of(make_chunk("r", params, output=[0]), logits) != pytest.approx(
        raw[1].item()
    )


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 10.0  # EOS is by far the most likely
    logits[0, 6] = 9.0  # then a stop token
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6])
    sampler = Sampler(VOCAB)
    early = sampler(logits, [make_chunk("r", params, output=[1], eos_token_id=5)])
    assert early.sampled_token_ids["r"] not in (5, 6)
    done = sampler(logits, [make_chunk("r", params, output=[1, 2, 3], eos_token_id=5)])
    assert done.sampled_token_ids["r"] == 5


def test_ignore_eos_does_not_suppress_eos() -> None:
    # vLLM: with ignore_eos, EOS is not a stop token, so min_tokens leaves it alone.
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 10.0
    params = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    out = Sampler(VOCAB)(logits, [make_chunk("r", params, output=[1], eos_token_id=5)])
    assert out.sampled_token_ids["r"] == 5


def test_logprobs_rank_and_top_k() -> None:
    logits = fixed_logits(2)
    chunks = [
        make_chunk("top3", SamplingParams(temperature=0.0, logprobs=3)),
        make_chunk("none", SamplingParams(temperature=0.0)),
    ]
    out = Sampler(VOCAB)(logits, chunks)
    expected = torch.log_softmax(logits[0], dim=-1)
    lp = out.logprobs["top3"]
    assert set(out.logprobs) == {"top3"}
    assert lp.token_id == 0 and lp.rank == 1
    assert lp.logprob == pytest.approx(expected[0].item())
    assert [t for t, _ in lp.top] == [0, 1, 4]
    assert [v for _, v in lp.top] == pytest.approx(expected[[0, 1, 4]].tolist())


def test_logprobs_rank_of_a_sampled_unlikely_token() -> None:
    logits = fixed_logits()
    params = SamplingParams(temperature=1.0, top_k=1, logprobs=0)  # forces token 0 ...
    logits_flipped = logits.clone()
    logits_flipped[0, 2] = 50.0  # ... unless token 2 dominates: it does, rank 1
    out = Sampler(VOCAB)(logits_flipped, [make_chunk("r", params)])
    assert out.logprobs["r"].rank == 1 and out.logprobs["r"].top == []
    # Temperature does not change the logprob: it is read before temperature.
    params = SamplingParams(temperature=0.0, min_tokens=1, logprobs=0)
    out = Sampler(VOCAB)(logits, [make_chunk("r", params, eos_token_id=0)])
    assert out.sampled_token_ids["r"] == 1
    assert out.logprobs["r"].rank == 2
    assert out.logprobs["r"].logprob == pytest.approx(
        torch.log_softmax(logits[0], dim=-1)[1].item()
    )


def test_empty_batch() -> None:
    out = Sampler(VOCAB)(torch.zeros(0, VOCAB), [])
    assert out.sampled_token_ids == {} and out.logprobs == {}
