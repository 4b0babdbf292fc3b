"""Repetition, frequency and presence penalties, over token counts kept on the sampling device.

A penalised request's counts are made once, when it first samples on a device: how often each
token id occurs in its outputs, and which ids its prompt holds. They live in one row (a slot)
of a table shared by every penalised request on that device (`PenaltyTable`), and each sampled
token is added where it was sampled, before its id reaches the host (async scheduling). A step
gathers its penalised rows' counts with one index and counts its tokens with one scatter,
however many rows it penalises. A request's slot is free again when its state is dropped.
The table doubles when it runs out of slots and never shrinks: it holds at most twice the
most penalised requests ever sampled together, (V + 1) * 4 + V bytes each (about 640 KiB at
a 128K vocabulary).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from engine.device_copy import to_device_async
from engine.sample.sampling_table import Feature, SamplingColumns

__all__ = ["PenalisedRow", "PenalisedRows", "PenaltyCounts", "PenaltyTable"]


class PenaltyCounts:
    """A penalised request's slot in its device's PenaltyTable; kept with the request."""

    __slots__ = ("__weakref__", "num_counted", "slot", "table")

    def __init__(self, table: PenaltyTable, slot: int) -> None:
        self.table = table
        self.slot = slot
        self.num_counted = 0  # outputs counted so far


class PenalisedRow(Protocol):
    """What penalties read of a request (engine.sampler.SampleRow)."""

    penalty_counts: PenaltyCounts | None  # None until it first samples

    @property
    def prompt_token_ids(self) -> list[int]: ...

    def output_tokens_since(self, start: int) -> list[int]: ...


class PenalisedRows:
    """The penalised rows of one sampling call: where their counts are, to count the tokens
    sampled from them (`count`)."""

    def __init__(self, table: PenaltyTable, rows: torch.Tensor, slots: torch.Tensor,
                 counts: list[PenaltyCounts]) -> None:
        self.table = table
        self.rows = rows  # int64[P] on the device: the call's rows
        self.slots = slots  # int64[P] on the device: their slots
        self.counts = counts

    def count(self, sampled: torch.Tensor) -> None:
        """sampled: int64[N], the call's tokens (on the device): each penalised row's counts
        take its own."""
        self.table.output_counts.index_put_(
            (self.slots, sampled[self.rows]), self.table.one, accumulate=True
        )
        for counts in self.counts:
            counts.num_counted += 1


class PenaltyTable:
    """Token counts of the penalised requests on one device, one slot each; grows on demand."""

    def __init__(self, vocab_size: int, device: torch.device, num_slots: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # The last column collects ids past the logits (tokenizer-only added tokens).
        self.output_counts = torch.zeros(num_slots, vocab_size + 1, device=device)  # float32
        self.prompt_seen = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self.one = torch.ones(1, device=device)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def apply(
        self, logits: torch.Tensor, columns: SamplingColumns, rows: Sequence[PenalisedRow]
    ) -> tuple[torch.Tensor, PenalisedRows | None]:
        """The logits (float32[N, V]) with each penalised row's penalties applied, and those
        rows (None when none is), whose counts take the tokens sampled next."""
        if not columns.features & Feature.PENALISED:
            return logits, None
        penalised = columns.rows_with(Feature.PENALISED)
        states = [rows[i] for i in penalised.tolist()]
        counts = self._counts_of(states, columns.num_output_tokens[penalised])
        device = logits.device
        slots = to_device_async([c.slot for c in counts], device)
        row_index = to_device_async(penalised, device)
        output_counts = self.output_counts.index_select(0, slots)[:, : self.vocab_size]
        prompt_seen = self.prompt_seen.index_select(0, slots)
        factors = to_device_async(columns.penalties[penalised], device, torch.float32)  # [P, 3]
        repetition, frequency, presence = factors[:, 0:1], factors[:, 1:2], factors[:, 2:3]
        selected = logits[row_index]  # [P, V]
        # HF repetition penalty: divide positive logits, multiply negative ones.
        seen = prompt_seen | (output_counts > 0)
        scaled = torch.where(selected > 0, selected / repetition, selected * repetition)
        selected = torch.where(seen, scaled, selected)
        # OpenAI penalties: per occurrence, and once for any occurrence.
        selected = selected - frequency * output_counts - presence * (output_counts > 0).float()
        logits = logits.clone()
        logits[row_index] = selected
        return logits, PenalisedRows(self, row_index, slots, counts)

    def _counts_of(self, states: list[PenalisedRow],
                   num_output_tokens: np.ndarray) -> list[PenaltyCounts]:
        """The states' counts, made (in full, from their tokens) for those without them here."""
        fresh = [s for s in states
                 if s.penalty_counts is None or s.penalty_counts.table is not self]
        if fresh:
            self._count_fresh(fresh)
        counts: list[PenaltyCounts] = []
        for state in states:
            assert state.penalty_counts is not None
            counts.append(state.penalty_counts)
        # Every token since came from this table's sampler, which counted it.
        assert [c.num_counted for c in counts] == num_output_tokens.tolist(), (
            "penalty counts out of step"
        )
        return counts

    def _count_fresh(self, states: list[PenalisedRow]) -> None:
        output_lists = [s.output_tokens_since(0) for s in states]
        new_counts = [self._acquire() for _ in states]
        slots = to_device_async([c.slot for c in new_counts], self.device)
        self.output_counts[slots] = self._token_counts(output_lists)
        prompts = self._token_counts([s.prompt_token_ids for s in states])
        self.prompt_seen[slots] = prompts[:, : self.vocab_size] > 0
        for state, counts, outputs in zip(states, new_counts, output_lists, strict=True):
            counts.num_counted = len(outputs)
            state.penalty_counts = counts

    def _acquire(self) -> PenaltyCounts:
        if not self._free:
            self._grow()
        counts = PenaltyCounts(self, self._free.pop())
        weakref.finalize(counts, self._free.append, counts.slot)  # free when the state goes
        return counts

    def _grow(self) -> None:
        old = self.output_counts.shape[0]
        self.output_counts = torch.cat([self.output_counts, torch.zeros_like(self.output_counts)])
        self.prompt_seen = torch.cat([self.prompt_seen, torch.zeros_like(self.prompt_seen)])
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _token_counts(self, token_lists: list[list[int]]) -> torch.Tensor:
        """float32[len(token_lists), V + 1]: how often each token id occurs in each list."""
        device = self.device
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
