"""Picks the next token of every sampled row from its logits: penalties, filters, seeds, logprobs.

The pipeline, in order (vLLM V1's order):

1. repetition penalty (HF: over prompt and output tokens), then frequency and presence
   penalties (OpenAI: over output tokens only);
2. logprobs, when asked, are taken here: log_softmax of the penalised logits, before min_tokens
   suppression, the grammar mask, temperature and the truncation filters. This is what
   TokenLogprobs documents.
   vLLM V1's default `raw_logprobs` reads the logits before penalties too; they differ only for
   requests that set penalties. Pass `logprobs_mode="raw"` for that behaviour;
3. min_tokens: while fewer outputs exist, the stop token ids and (unless ignore_eos, as in
   vLLM) the EOS token get -inf. ignore_eos itself is the engine's business: it stops on EOS
   or not, the sampler never suppresses EOS for it;
4. structured outputs: a row whose request follows a grammar has every token its matcher
   disallows at -inf (engine.grammar_mask), and its matcher takes the sampled token;
5. greedy rows (temperature 0) take the argmax; the others are divided by their temperature,
   filtered by min-p, top-k, then top-p (top-p measured after top-k), and sampled with the
   exponential-race trick: argmax(p / E) with E ~ Exp(1) picks a token with probability p.

Seeds are stateless: a seeded row's noise is a counter-based hash (splitmix64) of
(seed, sample_index, number of outputs so far, token id), so the same request gives the same
tokens whatever else is in the batch, on any device, and across preemption and resume. Rows
without a seed draw their noise from one generator shared by the sampler.

Everything runs as batched tensor ops grouped by feature. `Sampler.sample` leaves its result
on the device (`SampledTokens`): the runner copies it back without waiting, so that the next
step can be queued first (async scheduling), and reads it with `SampledTokens.output`. Only a
grammar makes sampling wait for the ids: its matchers take each token on the host before the
next step's mask. Penalty counts are kept on the device and take each sampled token there.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import llguidance
import torch

from engine.device_copy import to_device_async
from engine.grammar_mask import ConstrainedRow, advance_matchers, apply_grammar_masks
from engine.runner import ModelRunnerOutput, TokenLogprobs
from engine.sampling_params import SamplingParams

__all__ = [
    "PenaltyCounts",
    "SampleRow",
    "SampledTokens",
    "Sampler",
    "derive_seed",
    "filtered_probs",
    "seeded_exponential",
]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed64(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits (torch has no uint64 math)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix64(value: int) -> int:
    """splitmix64 finaliser on Python ints."""
    value = (value ^ (value >> 30)) * _MIX1 & _MASK64
    value = (value ^ (value >> 27)) * _MIX2 & _MASK64
    return value ^ (value >> 31)


def derive_seed(seed: int, sample_index: int, num_output_tokens: int) -> int:
    """The key of one sampling event of a seeded request, as a signed 64-bit int."""
    key = _mix64((seed + _GOLDEN) & _MASK64)
    key = _mix64((key ^ sample_index) + _GOLDEN & _MASK64)
    key = _mix64((key ^ num_output_tokens) + _GOLDEN & _MASK64)
    return _signed64(key)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seeded_exponential(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [R, V] where element (r, v) depends only on (keys[r], v).

    Element v of row r is output v of a splitmix64 stream started at keys[r]; int64 products
    wrap around as unsigned arithmetic would. The top 24 bits make a uniform in (0, 1),
    computed in float64: in float32 the top value (1 - 2**-25) rounds to 1.0, whose noise
    is 0, and p / 0 then picked a token whatever its probability (a NaN for a token
    filtered or masked to p = 0, which argmax takes: about 0.3 % of seeded steps at a
    49,152-token vocabulary sampled a token the grammar or top-k had excluded).
    """
    # keys: int64[R]
    offsets = torch.arange(1, vocab_size + 1, device=keys.device, dtype=torch.int64)
    z = keys[:, None] + offsets[None, :] * _signed64(_GOLDEN)  # [R, V]
    z = (z ^ _shift_right(z, 30)) * _signed64(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed64(_MIX2)
    z = z ^ _shift_right(z, 31)
    uniform = (_shift_right(z, 40).to(torch.float64) + 0.5) * (1.0 / (1 << 24))
    return (-torch.log(uniform)).to(torch.float32)


def filtered_probs(
    logits: torch.Tensor,  # [R, V]
    temperature: torch.Tensor,  # float32[R], > 0
    top_k: torch.Tensor,  # int64[R], in [1, V]; V disables
    top_p: torch.Tensor,  # float32[R], in (0, 1]; 1 disables
    min_p: torch.Tensor,  # float32[R], in [0, 1]; 0 disables
    *,
    use_top_k: bool = True,  # False: no row uses top-k (skips the work)
    use_top_p: bool = True,  # False: no row uses top-p
    use_min_p: bool = True,  # False: no row uses min-p
) -> torch.Tensor:  # [R, V] probabilities, zero outside the kept set
    """Temperature, then min-p, top-k and top-p (top-p measured on the top-k renormalised mass)."""
    logits = logits / temperature[:, None]
    if use_min_p:
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if use_top_k or use_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
        positions = torch.arange(logits.shape[1], device=logits.device)[None, :]
        # Top-k keeps the k largest (and anything tied with the k-th).
        kth = sorted_logits.gather(1, (top_k - 1)[:, None])
        drop_sorted = sorted_logits < kth
        if use_top_p:
            # Top-p keeps the shortest prefix whose mass reaches p (at least one token).
            kept = sorted_logits.masked_fill(drop_sorted, float("-inf"))
            sorted_probs = torch.softmax(kept, dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop_p = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
            drop_sorted = drop_sorted | (drop_p & (positions > 0))
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


class SampleRow(Protocol):
    """What the sampler reads of a request that samples this step
    (engine.input_batch.RequestState)."""

    request_id: str
    sampling_params: SamplingParams
    eos_token_id: int | None  # suppressed until min_tokens outputs exist
    sample_index: int  # seeded samples of one prompt differ by it
    penalty_counts: PenaltyCounts | None  # the sampler's, kept with the request; None at first
    matcher: llguidance.LLMatcher | None  # its grammar's state; None: unconstrained

    @property
    def prompt_token_ids(self) -> list[int]:  # repetition penalty
        ...

    @property
    def num_output_tokens(self) -> int:  # min_tokens, seeded noise
        ...

    def output_tokens_since(self, start: int) -> list[int]:  # penalties: outputs start..
        ...


@dataclass
class PenaltyCounts:
    """A penalised request's token counts on the sampling device, kept between steps."""

    output_counts: torch.Tensor  # float32[V + 1]; the last column: ids past the logits
    prompt_seen: torch.Tensor  # bool[V]
    num_counted: int  # outputs counted so far


@dataclass
class _LogprobTensors:
    """The logprobs asked for in one call, as tensors until read (`SampledTokens.output`)."""

    rows: list[int]  # the rows that asked, in row order
    num_top: list[int]  # how many top logprobs each of them asked for
    sampled_logprob: torch.Tensor  # float32[L]
    ranks: torch.Tensor  # int64[L]
    top_values: torch.Tensor | None  # float32[L, K] (K: the most asked), None when K is 0
    top_ids: torch.Tensor | None  # int64[L, K]


@dataclass
class SampledTokens:
    """One sampling call's result; its tensors stay where they were computed until `to_host`."""

    request_ids: list[str]  # one per row
    token_ids: torch.Tensor  # int64[N]
    # The ids already read back (a grammar's matchers took them), else None.
    host_token_ids: list[int] | None = None
    grammar_errors: dict[str, str] = field(default_factory=dict)
    logprobs: _LogprobTensors | None = None

    def to_host(self) -> SampledTokens:
        """The same in host memory. From an accelerator the copies go into pinned memory
        without waiting: read the result once the device has passed them (an event)."""
        device = self.token_ids.device
        if device.type == "cpu":
            return self

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return host.copy_(tensor, non_blocking=True)

        logprobs = self.logprobs
        if logprobs is not None:
            logprobs = _LogprobTensors(
                logprobs.rows, logprobs.num_top, copy(logprobs.sampled_logprob),
                copy(logprobs.ranks),
                None if logprobs.top_values is None else copy(logprobs.top_values),
                None if logprobs.top_ids is None else copy(logprobs.top_ids),
            )
        return SampledTokens(self.request_ids, copy(self.token_ids), self.host_token_ids,
                             self.grammar_errors, logprobs)

    def output(self) -> ModelRunnerOutput:
        """As the runner reports it (reads the tensors: on an accelerator, waits for them)."""
        token_ids = self.host_token_ids
        if token_ids is None:
            token_ids = self.token_ids.tolist()
        output = ModelRunnerOutput(
            sampled_token_ids=dict(zip(self.request_ids, token_ids, strict=True)),
            grammar_errors=self.grammar_errors,
        )
        if self.logprobs is not None:
            output.logprobs = _read_logprobs(self.logprobs, self.request_ids, token_ids)
        return output


def _read_logprobs(
    tensors: _LogprobTensors, request_ids: list[str], token_ids: list[int]
) -> dict[str, TokenLogprobs]:
    logprob_list: list[float] = tensors.sampled_logprob.tolist()
    rank_list: list[int] = tensors.ranks.tolist()
    top_values: list[list[float]] = (
        tensors.top_values.tolist() if tensors.top_values is not None else []
    )
    top_ids: list[list[int]] = tensors.top_ids.tolist() if tensors.top_ids is not None else []
    result: dict[str, TokenLogprobs] = {}
    for pos, (row, num) in enumerate(zip(tensors.rows, tensors.num_top, strict=True)):
        top = list(zip(top_ids[pos][:num], top_values[pos][:num], strict=True)) if num else []
        result[request_ids[row]] = TokenLogprobs(
            token_id=token_ids[row], logprob=logprob_list[pos], rank=rank_list[pos], top=top
        )
    return result


@dataclass
class _BatchParams:
    """Per-row sampling parameters of one call, as device tensors and Python flags."""

    # None when every row is greedy
    temperature: torch.Tensor | None  # float32[N]; only meaningful for random rows
    top_k: torch.Tensor | None  # int64[N]; vocab_size where disabled
    top_p: torch.Tensor | None  # float32[N]
    min_p: torch.Tensor | None  # float32[N]
    greedy_rows: list[int]  # rows with temperature 0
    random_rows: list[int]  # the other rows
    seeded_keys: dict[int, int]  # row -> derive_seed(...) for seeded random rows
    has_top_k: bool  # some random row uses top-k
    has_top_p: bool  # some random row uses top-p
    has_min_p: bool  # some random row uses min-p


class Sampler:
    """Samples one token per row of logits; one SampleRow per logits row, same order."""

    def __init__(
        self,
        vocab_size: int,
        seed: int | None = None,
        logprobs_mode: Literal["penalized", "raw"] = "penalized",
    ) -> None:
        self.vocab_size = vocab_size  # logits columns past this (padding) are dropped
        self.logprobs_mode = logprobs_mode  # see the module docstring, step 2
        self._seed = seed  # seeds the shared generator of unseeded rows, for reproducible runs
        self._generators: dict[torch.device, torch.Generator] = {}
        self._ones: dict[torch.device, torch.Tensor] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._generators[device] = generator
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SampleRow]) -> ModelRunnerOutput:
        """Sample and read the result back (`sample`, then `SampledTokens.output`)."""
        return self.sample(logits, seqs).output()

    def sample(self, logits: torch.Tensor, seqs: Sequence[SampleRow]) -> SampledTokens:
        """logits: float32[num_sampled, >= vocab_size], one row per request that samples."""
        assert logits.shape[0] == len(seqs), "one logits row per request that samples"
        request_ids = [c.request_id for c in seqs]
        if not seqs:
            return SampledTokens(request_ids, torch.empty(0, dtype=torch.int64), [])
        logits = logits[:, : self.vocab_size].to(torch.float32)
        raw_logits = logits
        logits, penalised = self._apply_penalties(logits, seqs)

        logprob_rows = [i for i, c in enumerate(seqs) if c.sampling_params.logprobs is not None]
        logprobs = None
        if logprob_rows:
            source = raw_logits if self.logprobs_mode == "raw" else logits
            logprobs = torch.log_softmax(source[logprob_rows], dim=-1)  # [L, V]

        unsuppressed = logits
        logits = self._apply_min_tokens(logits, seqs)
        constrained: list[ConstrainedRow] = [
            (i, c.matcher) for i, c in enumerate(seqs) if c.matcher is not None
        ]
        if constrained:
            # The grammar wins over min_tokens only where min_tokens suppresses something.
            suppressing = any(
                seqs[i].num_output_tokens < seqs[i].sampling_params.min_tokens
                for i, _ in constrained
            )
            logits = apply_grammar_masks(logits, constrained,
                                         unsuppressed if suppressing else None)
        params = self._batch_params(seqs, logits.device)
        sampled = self._sample(logits, params)  # int64[N]
        for row, counts in penalised:  # the counts take the token where they are
            counts.output_counts.index_put_(
                (sampled[row : row + 1],), self._one(sampled.device), accumulate=True
            )
            counts.num_counted += 1

        result = SampledTokens(request_ids, sampled)
        if constrained:
            result.host_token_ids = sampled.tolist()
            failed = advance_matchers(constrained, result.host_token_ids)
            result.grammar_errors = {seqs[row].request_id: why for row, why in failed.items()}
        if logprobs is not None:
            result.logprobs = self._logprob_tensors(logprobs, sampled, seqs, logprob_rows)
        return result

    def _one(self, device: torch.device) -> torch.Tensor:
        one = self._ones.get(device)
        if one is None:
            one = self._ones[device] = torch.ones(1, dtype=torch.float32, device=device)
        return one

    # -- penalties ---------------------------------------------------------------------------

    def _apply_penalties(
        self, logits: torch.Tensor, seqs: Sequence[SampleRow]
    ) -> tuple[torch.Tensor, list[tuple[int, PenaltyCounts]]]:
        """The penalised logits, and the penalised rows with their counts (which take the
        token sampled from them)."""
        rows = [
            i
            for i, c in enumerate(seqs)
            if c.sampling_params.repetition_penalty != 1.0
            or c.sampling_params.presence_penalty != 0.0
            or c.sampling_params.frequency_penalty != 0.0
        ]
        if not rows:
            return logits, []
        device = logits.device
        penalised = [seqs[i] for i in rows]
        states = self._penalty_counts(penalised, device)
        output_counts = torch.stack([s.output_counts[: self.vocab_size] for s in states])
        prompt_seen = torch.stack([s.prompt_seen for s in states])
        repetition = self._row_tensor([c.sampling_params.repetition_penalty for c in penalised],
                                      device)
        frequency = self._row_tensor([c.sampling_params.frequency_penalty for c in penalised],
                                     device)
        presence = self._row_tensor([c.sampling_params.presence_penalty for c in penalised], device)

        row_index = to_device_async(rows, device)
        selected = logits[row_index]  # [P, V]
        # HF repetition penalty: divide positive logits, multiply negative ones.
        seen = prompt_seen | (output_counts > 0)
        scaled = torch.where(selected > 0, selected / repetition, selected * repetition)
        selected = torch.where(seen, scaled, selected)
        # OpenAI penalties: per occurrence, and once for any occurrence.
        selected = selected - frequency * output_counts - presence * (output_counts > 0).float()
        logits = logits.clone()
        logits[row_index] = selected
        return logits, list(zip(rows, states, strict=True))

    def _penalty_counts(self, seqs: list[SampleRow], device: torch.device) -> list[PenaltyCounts]:
        """The penalised rows' token counts, kept with each request (SampleRow.penalty_counts):
        counted in full when it first samples here, then taking each token it samples
        (`sample`), so that a token still on the device counts."""
        fresh = [
            s for s in seqs
            if s.penalty_counts is None or s.penalty_counts.output_counts.device != device
        ]
        if fresh:
            output_lists = [s.output_tokens_since(0) for s in fresh]
            outputs = self._token_counts(output_lists, device)
            prompts = self._token_counts([s.prompt_token_ids for s in fresh], device)
            for index, seq in enumerate(fresh):
                seq.penalty_counts = PenaltyCounts(
                    outputs[index].clone(), prompts[index, : self.vocab_size] > 0,
                    len(output_lists[index]),
                )
        states: list[PenaltyCounts] = []
        for seq in seqs:
            state = seq.penalty_counts
            assert state is not None
            # Every token since came from this sampler, which counted it.
            assert state.num_counted == seq.num_output_tokens, "penalty counts out of step"
            states.append(state)
        return states

    def _token_counts(self, token_lists: list[list[int]], device: torch.device) -> torch.Tensor:
        """float32[len(token_lists), V + 1]: how often each token id occurs in each list."""
        # One spare column collects ids the logits do not cover (tokenizer-only added tokens).
        counts = torch.zeros(len(token_lists), self.vocab_size + 1, device=device)
        lengths = to_device_async([len(tokens) for tokens in token_lists], device)
        flat = to_device_async(list(itertools.chain.from_iterable(token_lists)),
                          device).clamp_(max=self.vocab_size)
        if flat.numel():
            # output_size spares the device-to-host sync repeat_interleave does to size its output.
            rows = torch.repeat_interleave(
                torch.arange(len(token_lists), device=device), lengths, output_size=flat.numel()
            )
            counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.float32),
                              accumulate=True)
        return counts

    @staticmethod
    def _row_tensor(values: list[float], device: torch.device) -> torch.Tensor:
        """float32[len(values), 1], to broadcast over the vocabulary."""
        return to_device_async(values, device, torch.float32)[:, None]

    # -- min_tokens ----------------------------------------------------------------------------

    @staticmethod
    def _apply_min_tokens(logits: torch.Tensor, seqs: Sequence[SampleRow]) -> torch.Tensor:
        rows: list[int] = []
        token_ids: list[int] = []
        for i, seq in enumerate(seqs):
            params = seq.sampling_params
            if seq.num_output_tokens >= params.min_tokens:
                continue
            suppressed = set(params.stop_token_ids)
            if seq.eos_token_id is not None and not params.ignore_eos:
                suppressed.add(seq.eos_token_id)
            suppressed = {t for t in suppressed if t < logits.shape[1]}
            rows.extend([i] * len(suppressed))
            token_ids.extend(sorted(suppressed))
        if not rows:
            return logits
        logits = logits.clone()
        index = (to_device_async(rows, logits.device), to_device_async(token_ids, logits.device))
        logits[index] = float("-inf")
        return logits

    # -- sampling ------------------------------------------------------------------------------

    def _batch_params(self, seqs: Sequence[SampleRow], device: torch.device) -> _BatchParams:
        params = [c.sampling_params for c in seqs]
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        if len(greedy_rows) == len(params):  # argmax only: no parameter reaches the device
            return _BatchParams(None, None, None, None, greedy_rows, [], {}, False, False, False)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        seeded_keys = {
            i: derive_seed(seed, seqs[i].sample_index, seqs[i].num_output_tokens)
            for i in random_rows
            if (seed := params[i].seed) is not None
        }
        randoms = [params[i] for i in random_rows]
        vocab_size = self.vocab_size
        # One host tensor, one copy: temperature, top-k (vocab_size: off), top-p, min-p.
        table = to_device_async(
            [
                (p.temperature, min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size,
                 p.top_p, p.min_p)
                for p in params
            ],
            device,
            torch.float64,
        )
        return _BatchParams(
            temperature=table[:, 0].to(torch.float32),
            top_k=table[:, 1].to(torch.int64),
            top_p=table[:, 2].to(torch.float32),
            min_p=table[:, 3].to(torch.float32),
            greedy_rows=greedy_rows,
            random_rows=random_rows,
            seeded_keys=seeded_keys,
            has_top_k=any(0 < p.top_k < vocab_size for p in randoms),
            has_top_p=any(p.top_p < 1.0 for p in randoms),
            has_min_p=any(p.min_p > 0.0 for p in randoms),
        )

    def _sample(self, logits: torch.Tensor, params: _BatchParams) -> torch.Tensor:
        """int64[N]: greedy rows by argmax, random rows by filtered sampling."""
        if not params.random_rows:
            return logits.argmax(dim=-1)
        all_random = len(params.random_rows) == logits.shape[0]
        index = None if all_random else to_device_async(params.random_rows, logits.device)

        def pick(t: torch.Tensor | None) -> torch.Tensor:
            assert t is not None, "random rows have parameters"
            return t if index is None else t[index]

        probs = filtered_probs(
            pick(logits),
            pick(params.temperature),
            pick(params.top_k),
            pick(params.top_p),
            pick(params.min_p),
            use_top_k=params.has_top_k,
            use_top_p=params.has_top_p,
            use_min_p=params.has_min_p,
        )
        noise = self._noise(probs, params)
        random_sampled = (probs / noise).argmax(dim=-1)
        if index is None:
            return random_sampled
        sampled = logits.argmax(dim=-1)
        sampled[index] = random_sampled
        return sampled

    def _noise(self, probs: torch.Tensor, params: _BatchParams) -> torch.Tensor:
        """Exp(1) noise [R, V] for the random rows: hashed for seeded rows, shared otherwise."""
        noise = torch.empty_like(probs)
        num_rows = probs.shape[0]
        seeded_positions = [
            pos for pos, row in enumerate(params.random_rows) if row in params.seeded_keys
        ]
        if len(seeded_positions) < num_rows:
            noise.exponential_(generator=self._generator(probs.device))
        if seeded_positions:
            keys = to_device_async(
                [params.seeded_keys[params.random_rows[pos]] for pos in seeded_positions],
                probs.device,
            )
            hashed = seeded_exponential(keys, probs.shape[1])
            if len(seeded_positions) == num_rows:
                noise = hashed
            else:
                noise[to_device_async(seeded_positions, probs.device)] = hashed
        return noise

    # -- logprobs ------------------------------------------------------------------------------

    @staticmethod
    def _logprob_tensors(
        logprobs: torch.Tensor,  # [L, V]
        sampled: torch.Tensor,  # int64[N]
        seqs: Sequence[SampleRow],
        rows: list[int],  # the L rows that asked for logprobs
    ) -> _LogprobTensors:
        sampled_ids = sampled[to_device_async(rows, sampled.device)][:, None]  # [L, 1]
        sampled_logprob = logprobs.gather(1, sampled_ids)  # [L, 1]
        # 1-based rank: tokens strictly more likely, plus one.
        ranks = (logprobs > sampled_logprob).sum(dim=-1) + 1
        num_top = [seqs[i].sampling_params.logprobs or 0 for i in rows]
        top_values, top_ids = logprobs.topk(max(num_top), dim=-1) if max(num_top) else (None, None)
        return _LogprobTensors(rows, num_top, sampled_logprob[:, 0], ranks, top_values, top_ids)
