"""SamplingTable: the sampling parameters of a batch's rows as arrays, set once per request.

Each step the sampler reads the parameters of the rows it samples: which are greedy, their
temperatures and filters, penalties, logprobs, min_tokens, seeds, grammars. Kept as columns,
one entry per row of the runner's batch (engine.input_batch), they are written once, when a
request joins, and a step gathers the sampled rows' with fancy-index reads (`gather`) instead
of a loop over the requests' Python objects: the flags at once, the other columns when the
sampler first asks (a greedy batch reads no more). The sampler then decides with vectorized
numpy (`SamplingColumns`), and what reaches the device goes in one copy. What depends only on
the request is computed when it joins (a seeded request's key, engine.seeded_noise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Protocol

import numpy as np

from engine.sample.seeded_noise import request_key
from engine.sampling_params import SamplingParams

__all__ = ["Feature", "SamplingColumns", "SamplingTable"]

# Columns of the int table.
_NUM_LOGPROBS, _MIN_TOKENS, _SEED_KEY, _FLAGS = range(4)


class Feature:
    """Bits of a row's flags: what its sampling needs beyond an argmax (plain ints, cheap to
    test; a call's `SamplingColumns.features` ORs its rows', so an absent feature costs one
    test)."""

    RANDOM = 1  # temperature > 0
    TOP_K = 2  # top_k set
    TOP_P = 4  # top_p < 1
    MIN_P = 8  # min_p > 0
    PENALISED = 16  # a repetition, frequency or presence penalty
    SEEDED = 32  # a seed
    LOGPROBS = 64  # logprobs asked
    MIN_TOKENS = 128  # min_tokens > 0
    CONSTRAINED = 256  # follows a grammar


def _flags(params: SamplingParams, is_constrained: bool) -> int:
    return (
        (not params.is_greedy) * Feature.RANDOM
        | (params.top_k > 0) * Feature.TOP_K
        | (params.top_p < 1.0) * Feature.TOP_P
        | (params.min_p > 0.0) * Feature.MIN_P
        | (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
           or params.presence_penalty != 0.0) * Feature.PENALISED
        | (params.seed is not None) * Feature.SEEDED
        | (params.logprobs is not None) * Feature.LOGPROBS
        | (params.min_tokens > 0) * Feature.MIN_TOKENS
        | is_constrained * Feature.CONSTRAINED
    )


class _Row(Protocol):
    """What `SamplingColumns.of` reads of a row (engine.sampler.SampleRow)."""

    sampling_params: SamplingParams
    sample_index: int

    @property
    def matcher(self) -> object | None: ...  # its grammar's state; None: unconstrained

    @property
    def num_output_tokens(self) -> int: ...


class SamplingColumns:
    """The parameters of the rows one sampling call samples, in its row order."""

    def __init__(self, table: SamplingTable, rows: np.ndarray,
                 num_output_tokens: Callable[[np.ndarray], np.ndarray]) -> None:
        """rows: int64[N], table rows in the call's order; num_output_tokens: the outputs so
        far of table rows (they change every step: the caller keeps them)."""
        self._table = table
        self._rows = rows
        self._num_output_tokens = num_output_tokens
        ints = table.ints[rows]
        self.num_logprobs = ints[:, _NUM_LOGPROBS]  # int64[N]; -1: none asked
        self.min_tokens = ints[:, _MIN_TOKENS]  # int64[N]
        # int64[N]: seeded_noise.request_key(seed, sample_index), where SEEDED
        self.seed_key = ints[:, _SEED_KEY]
        self.flags = ints[:, _FLAGS]  # int64[N]: Feature bits
        self.features = int(np.bitwise_or.reduce(self.flags))  # the rows' flags ORed

    @cached_property
    def _floats(self) -> np.ndarray:  # float32[N, 7]: filters, then penalties
        return self._table.floats[self._rows]

    @property
    def filters(self) -> np.ndarray:
        """float32[N, 4]: temperature (used where Feature.RANDOM), top-k (inf: off), top-p
        (1: off), min-p (0: off), in the dtype and order the sampler's device table takes."""
        return self._floats[:, :4]

    @property
    def penalties(self) -> np.ndarray:
        """float32[N, 3]: repetition (1: off), frequency (0: off), presence (0: off)."""
        return self._floats[:, 4:]

    @cached_property
    def num_output_tokens(self) -> np.ndarray:
        """int64[N]: outputs so far, those still on the device included."""
        return self._num_output_tokens(self._rows)

    @property
    def top_k(self) -> np.ndarray:  # float32[N]; inf: off
        return self.filters[:, 1]

    def rows_with(self, feature: int) -> np.ndarray:
        """int64[K]: the rows whose flags have feature, in row order."""
        return np.flatnonzero(self.flags & feature)

    @classmethod
    def of(cls, rows: Sequence[_Row]) -> SamplingColumns:
        """The columns of rows held in no table (a sampler called on its own)."""
        table = SamplingTable(len(rows))
        for index, row in enumerate(rows):
            table.set(index, row.sampling_params, row.sample_index, row.matcher is not None)
        num_output_tokens = np.fromiter((r.num_output_tokens for r in rows), np.int64, len(rows))
        return cls(table, np.arange(len(rows)), num_output_tokens.__getitem__)


class SamplingTable:
    """One row of sampling parameters per row of a batch; rows grow on demand."""

    def __init__(self, num_rows: int) -> None:
        num_rows = max(num_rows, 1)
        # SamplingColumns.filters, then SamplingColumns.penalties
        self.floats = np.zeros((num_rows, 7), dtype=np.float32)
        self.ints = np.zeros((num_rows, 4), dtype=np.int64)

    def set(self, row: int, params: SamplingParams, sample_index: int,
            is_constrained: bool) -> None:
        """Row row now holds a request with these parameters."""
        if row >= self.ints.shape[0]:
            self._grow(row + 1)
        top_k = params.top_k if params.top_k > 0 else np.inf
        self.floats[row] = (params.temperature, top_k, params.top_p, params.min_p,
                            params.repetition_penalty, params.frequency_penalty,
                            params.presence_penalty)
        self.ints[row] = (
            -1 if params.logprobs is None else params.logprobs,
            params.min_tokens,
            0 if params.seed is None else request_key(params.seed, sample_index),
            _flags(params, is_constrained),
        )

    def gather(self, rows: np.ndarray,
               num_output_tokens: Callable[[np.ndarray], np.ndarray]) -> SamplingColumns:
        """The columns of rows (int64[N], in the sampler's row order); num_output_tokens: the
        outputs so far of table rows, asked only if the sampler needs them."""
        return SamplingColumns(self, rows, num_output_tokens)

    def _grow(self, num_rows: int) -> None:
        num_rows = max(num_rows, 2 * self.ints.shape[0])
        self.floats = _grown(self.floats, num_rows)
        self.ints = _grown(self.ints, num_rows)


def _grown(array: np.ndarray, num_rows: int) -> np.ndarray:
    out = np.zeros((num_rows, array.shape[1]), dtype=array.dtype)
    out[: array.shape[0]] = array
    return out
