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

The rows' parameters come as columns (engine.sampling_table): the runner's batch keeps them,
so a step decides which rows are greedy, penalised, seeded or asking logprobs with vectorized
numpy rather than a loop over the requests. Everything runs as batched tensor ops grouped by
feature, and each feature's host table reaches the device in one copy. `Sampler.sample`
leaves its result on the device (`SampledTokens`): the runner copies it back without waiting,
so that the next step can be queued first (async scheduling), and reads it with
`SampledTokens.output`. Only a grammar makes sampling wait for the ids: its matchers take
each token on the host before the next step's mask. Penalty counts are kept on the device and
take each sampled token there (engine.penalties).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import llguidance
import numpy as np
import torch

from engine.device_copy import to_device_async
from engine.errors import RequestFault
from engine.sample.closing_nudge import nudge_towards_closing
from engine.sample.grammar_mask import (
    ConstrainedRow,
    GrammarWork,
    advance_matchers,
    apply_grammar_masks,
)
from engine.sample.penalties import PenaltyCounts, PenaltyTable
from engine.sample.sampling_table import Feature, SamplingColumns
from engine.sample.seeded_noise import event_keys, seeded_exponential
from engine.sampling_params import SamplingParams
from engine.types import ModelRunnerOutput, TokenLogprobs

__all__ = [
    "SampleRow",
    "SampledTokens",
    "Sampler",
    "filtered_probs",
]

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
    json_closers: np.ndarray | None  # a JSON constraint's closing tokens (closing_nudge)

    @property
    def prompt_token_ids(self) -> list[int]:  # repetition penalty
        ...

    @property
    def num_output_tokens(self) -> int:  # min_tokens, seeded noise
        ...

    def output_tokens_since(self, start: int) -> list[int]:  # penalties: outputs start..
        ...


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
    grammar_faults: dict[str, RequestFault] = field(default_factory=dict)
    grammar_seconds: dict[str, float] = field(default_factory=dict)
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
                             self.grammar_faults, self.grammar_seconds, logprobs)

    def output(self) -> ModelRunnerOutput:
        """As the runner reports it (reads the tensors: on an accelerator, waits for them)."""
        token_ids = self.host_token_ids
        if token_ids is None:
            token_ids = self.token_ids.tolist()
        output = ModelRunnerOutput(
            request_ids=self.request_ids,
            token_ids=token_ids,
            grammar_faults=self.grammar_faults,
            grammar_seconds=self.grammar_seconds,
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
    """Per-row sampling parameters of one call, as device tensors and host arrays."""

    # None when every row is greedy
    temperature: torch.Tensor | None  # float32[N]; only meaningful for random rows
    top_k: torch.Tensor | None  # int64[N]; vocab_size where disabled
    top_p: torch.Tensor | None  # float32[N]
    min_p: torch.Tensor | None  # float32[N]
    random_rows: np.ndarray  # int64[R]: the rows with temperature > 0
    seeded_keys: np.ndarray  # int64[K]: the seeded random rows' keys (seeded_noise)
    is_seeded: np.ndarray  # bool[R]: the random rows with a seed (empty: none has)
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
        self._penalty_tables: dict[torch.device, PenaltyTable] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._generators[device] = generator
        return self._generators[device]

    def penalty_table(self, device: torch.device) -> PenaltyTable:
        """The token counts of the penalised requests sampled on device."""
        table = self._penalty_tables.get(device)
        if table is None:
            table = self._penalty_tables[device] = PenaltyTable(self.vocab_size, device)
        return table

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SampleRow]) -> ModelRunnerOutput:
        """Sample and read the result back (`sample`, then `SampledTokens.output`)."""
        return self.sample(logits, seqs).output()

    def sample(
        self,
        logits: torch.Tensor,
        seqs: Sequence[SampleRow],
        columns: SamplingColumns | None = None,
    ) -> SampledTokens:
        """logits: float32[num_sampled, >= vocab_size], one row per request that samples;
        columns: their parameters (the runner's batch keeps them: engine.sampling_table),
        None to read them from seqs."""
        assert logits.shape[0] == len(seqs), "one logits row per request that samples"
        request_ids = [c.request_id for c in seqs]
        if not seqs:
            return SampledTokens(request_ids, torch.empty(0, dtype=torch.int64), [])
        if columns is None:
            columns = SamplingColumns.of(seqs)
        logits = logits[:, : self.vocab_size].to(torch.float32)
        raw_logits = logits
        logits, penalised = self.penalty_table(logits.device).apply(logits, columns, seqs)

        features = columns.features
        logprobs = None
        logprob_rows = np.zeros(0, dtype=np.int64)
        if features & Feature.LOGPROBS:
            logprob_rows = columns.rows_with(Feature.LOGPROBS)
            source = raw_logits if self.logprobs_mode == "raw" else logits
            logprobs = torch.log_softmax(source[to_device_async(logprob_rows, logits.device)],
                                         dim=-1)  # [L, V]

        unsuppressed = logits
        below_min = np.zeros(0, dtype=np.int64)
        if features & Feature.MIN_TOKENS:
            below_min = np.flatnonzero(columns.num_output_tokens < columns.min_tokens)
            logits = self._apply_min_tokens(logits, seqs, below_min)
        constrained: list[ConstrainedRow] = []
        grammar = GrammarWork()
        if features & Feature.CONSTRAINED:
            rows = columns.rows_with(Feature.CONSTRAINED)
            constrained = [(i, m) for i in rows.tolist() if (m := seqs[i].matcher) is not None]
            # Near max_tokens, a JSON reply leans towards closing (engine.closing_nudge).
            logits = nudge_towards_closing(logits, [
                (i, limit - seqs[i].num_output_tokens, limit, closers) for i, _ in constrained
                if (closers := seqs[i].json_closers) is not None
                and (limit := seqs[i].sampling_params.max_tokens) is not None])
            # The grammar wins over min_tokens only where min_tokens suppresses something.
            suppressing = bool(np.isin(rows, below_min).any())
            logits = apply_grammar_masks(logits, constrained,
                                         unsuppressed if suppressing else None, grammar)
        params = self._batch_params(columns, logits.device)
        sampled = self._sample(logits, params)  # int64[N]
        if penalised is not None:  # the counts take the tokens where they are
            penalised.count(sampled)

        result = SampledTokens(request_ids, sampled)
        if constrained:
            result.host_token_ids = sampled.tolist()
            advance_matchers(constrained, result.host_token_ids, grammar)
            result.grammar_faults = {seqs[row].request_id: fault
                                     for row, fault in grammar.faults.items()}
            result.grammar_seconds = {seqs[row].request_id: seconds
                                      for row, seconds in grammar.seconds.items()}
        if logprobs is not None:
            result.logprobs = self._logprob_tensors(logprobs, sampled, columns, logprob_rows)
        return result

    # -- min_tokens ----------------------------------------------------------------------------

    @staticmethod
    def _apply_min_tokens(
        logits: torch.Tensor, seqs: Sequence[SampleRow], below_min: np.ndarray
    ) -> torch.Tensor:
        """below_min: the rows with fewer outputs than their min_tokens."""
        rows: list[int] = []
        token_ids: list[int] = []
        width = logits.shape[1]
        for i in below_min.tolist():
            seq = seqs[i]
            params = seq.sampling_params
            # Built once per request (SamplingParams), not once per row per step.
            suppressed = params.sorted_stop_token_ids
            if suppressed and suppressed[-1] >= width:
                suppressed = tuple(t for t in suppressed if t < width)
            eos = seq.eos_token_id
            if (eos is not None and not params.ignore_eos and eos < width
                    and eos not in params.stop_token_set):
                suppressed = (*suppressed, eos)
            rows.extend([i] * len(suppressed))
            token_ids.extend(suppressed)
        if not rows:
            return logits
        logits = logits.clone()
        index = (to_device_async(rows, logits.device), to_device_async(token_ids, logits.device))
        logits[index] = float("-inf")
        return logits

    # -- sampling ------------------------------------------------------------------------------

    def _batch_params(self, columns: SamplingColumns, device: torch.device) -> _BatchParams:
        if not columns.features & Feature.RANDOM:  # argmax only: no parameter reaches the device
            empty = np.zeros(0, dtype=np.int64)
            return _BatchParams(None, None, None, None, empty, empty,
                                np.zeros(0, dtype=np.bool_), False, False, False)
        random_rows = columns.rows_with(Feature.RANDOM)
        random_flags, random_features = columns.flags, columns.features
        if random_rows.size < random_flags.size:  # some rows are greedy
            random_flags = random_flags[random_rows]
            random_features = int(np.bitwise_or.reduce(random_flags))
        is_seeded = np.zeros(0, dtype=np.bool_)
        seeded_keys = np.zeros(0, dtype=np.int64)
        if random_features & Feature.SEEDED:
            is_seeded = (random_flags & Feature.SEEDED) != 0
            seeded = random_rows[is_seeded]
            seeded_keys = event_keys(columns.seed_key[seeded], columns.num_output_tokens[seeded])
        vocab_size = self.vocab_size
        has_top_k = bool(random_features & Feature.TOP_K) and bool(
            (columns.top_k[random_rows] < vocab_size).any()
        )
        # One host table, one copy: temperature, top-k (vocab_size: off), top-p, min-p.
        filters = columns.filters.copy()
        np.minimum(filters[:, 1], vocab_size, out=filters[:, 1])
        table = to_device_async(filters, device, torch.float32)
        return _BatchParams(
            temperature=table[:, 0],
            top_k=table[:, 1].to(torch.int64),
            top_p=table[:, 2],
            min_p=table[:, 3],
            random_rows=random_rows,
            seeded_keys=seeded_keys,
            is_seeded=is_seeded,
            has_top_k=has_top_k,
            has_top_p=bool(random_features & Feature.TOP_P),
            has_min_p=bool(random_features & Feature.MIN_P),
        )

    def _sample(self, logits: torch.Tensor, params: _BatchParams) -> torch.Tensor:
        """int64[N]: greedy rows by argmax, random rows by filtered sampling."""
        if not params.random_rows.size:
            return logits.argmax(dim=-1)
        all_random = params.random_rows.size == logits.shape[0]
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
        num_seeded = int(params.seeded_keys.size)
        if num_seeded < num_rows:
            noise.exponential_(generator=self._generator(probs.device))
        if num_seeded:
            hashed = seeded_exponential(to_device_async(params.seeded_keys, probs.device),
                                        probs.shape[1])
            if num_seeded == num_rows:
                noise = hashed
            else:
                noise[to_device_async(np.flatnonzero(params.is_seeded), probs.device)] = hashed
        return noise

    # -- logprobs ------------------------------------------------------------------------------

    @staticmethod
    def _logprob_tensors(
        logprobs: torch.Tensor,  # [L, V]
        sampled: torch.Tensor,  # int64[N]
        columns: SamplingColumns,
        rows: np.ndarray,  # int64[L]: the rows that asked for logprobs
    ) -> _LogprobTensors:
        sampled_ids = sampled[to_device_async(rows, sampled.device)][:, None]  # [L, 1]
        sampled_logprob = logprobs.gather(1, sampled_ids)  # [L, 1]
        # 1-based rank: tokens strictly more likely, plus one.
        ranks = (logprobs > sampled_logprob).sum(dim=-1) + 1
        num_top: list[int] = columns.num_logprobs[rows].tolist()
        top_values, top_ids = logprobs.topk(max(num_top), dim=-1) if max(num_top) else (None, None)
        return _LogprobTensors(rows.tolist(), num_top, sampled_logprob[:, 0], ranks, top_values,
                               top_ids)
