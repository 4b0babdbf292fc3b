"""Masks the logits of the rows whose output follows a grammar, and advances their matchers
with what was sampled.

Each constrained row's matcher writes the allowed tokens as a bitmask (32 tokens an int32)
into one host tensor; one copy takes it to the logits' device, where a byte lookup expands
it to the vocabulary and every disallowed token gets -inf. Rows without a matcher cost nothing: the
work is proportional to the constrained rows only.

What each row's matcher costs (its mask and its advance) is timed and reported per row
(`GrammarWork`): a grammar can be written so that its masks grow slower token by token (an
ambiguous Lark grammar's did with every token: ops/bench/journal.md, "Costly but valid
requests"), and that time is the request's, to charge and to bound (engine.grammar_budget),
not the step's. A matcher that fails, or that raises anything (a panic inside the native
library surfaces as a BaseException), fails its row only.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import llguidance
import torch

from engine.device_copy import to_device_async
from engine.errors import RequestErrorCode, RequestFault, is_fatal

__all__ = [
    "ConstrainedRow",
    "GrammarWork",
    "advance_matchers",
    "apply_grammar_masks",
    "disallowed_tokens",
]

logger = logging.getLogger(__name__)

ConstrainedRow = tuple[int, llguidance.LLMatcher]  # (logits row, its matcher)


@dataclass(slots=True)
class GrammarWork:
    """One step's grammar work, by logits row."""

    seconds: dict[int, float] = field(default_factory=dict)  # mask + advance time
    faults: dict[int, RequestFault] = field(default_factory=dict)

    def add_time(self, row: int, seconds: float) -> None:
        self.seconds[row] = self.seconds.get(row, 0.0) + seconds


def _panic(row: int, exc: BaseException, work: GrammarWork) -> None:
    if is_fatal(exc):
        raise exc
    logger.error("a grammar matcher raised %s", type(exc).__name__)
    work.faults.setdefault(row, RequestFault(
        RequestErrorCode.GRAMMAR_INTERNAL_ERROR,
        f"the grammar library failed on this request's grammar ({type(exc).__name__})",
    ))

_BYTE_TABLES: dict[torch.device, torch.Tensor] = {}


def _byte_table(device: torch.device) -> torch.Tensor:
    """bool[256, 8]: for a byte of a bitmask, which of its 8 tokens are disallowed."""
    table = _BYTE_TABLES.get(device)
    if table is None:
        values = torch.arange(256, dtype=torch.int32)[:, None]
        bits = (values >> torch.arange(8, dtype=torch.int32)[None, :]) & 1
        table = _BYTE_TABLES[device] = (bits == 0).to(device)
    return table


def disallowed_tokens(rows: Sequence[ConstrainedRow], vocab_size: int,
                      device: torch.device, work: GrammarWork | None = None) -> torch.Tensor:
    """bool[len(rows), vocab_size]: the tokens each row's grammar does not allow next.

    The matchers write one bit a token (token t: bit t % 32 of int32 word t // 32); read as
    little-endian bytes, byte j holds tokens 8j..8j+7, which one lookup expands to bools:
    one pass over the vocabulary (shifting out all 32 bits of each word took four, and
    several times the tensor work: ops/bench/journal.md, "Structured outputs: the library,
    the mask, and what a constraint costs")."""
    words = (vocab_size + 31) // 32
    # On a GPU the forward is still running while the matchers fill this (host) bitmask.
    bitmask = torch.empty((len(rows), words), dtype=torch.int32,
                          pin_memory=device.type == "cuda")
    work = GrammarWork() if work is None else work
    clock = time.perf_counter
    for index, (row, matcher) in enumerate(rows):
        pointer = bitmask[index].data_ptr()
        started = clock()
        try:
            matcher.unsafe_compute_mask_ptr(pointer, words * 4)
        except BaseException as exc:
            _panic(row, exc, work)
            ctypes.memset(pointer, 0xFF, words * 4)  # any token: the request ends anyway
        work.add_time(row, clock() - started)
    as_bytes = bitmask.view(torch.uint8).to(device, non_blocking=True)  # [R, 4W]
    # index_select with int32 indices: several times faster than indexing with int64.
    expanded = _byte_table(device).index_select(0, as_bytes.reshape(-1).to(torch.int32))
    return expanded.view(len(rows), words * 32)[:, :vocab_size]


def apply_grammar_masks(
    logits: torch.Tensor,  # float32[N, V], after penalties and min_tokens
    rows: Sequence[ConstrainedRow],  # in row order
    unsuppressed: torch.Tensor | None,  # the same before min_tokens, when it suppressed any
    work: GrammarWork,  # takes each row's mask time and faults
) -> torch.Tensor:
    """The logits with every token the rows' grammars disallow at -inf. A row whose grammar
    allows only what min_tokens suppresses (the end, once the grammar is complete) keeps
    the grammar's tokens: the grammar wins over min_tokens."""
    disallowed = disallowed_tokens(rows, logits.shape[1], logits.device, work)
    every_row = len(rows) == logits.shape[0]
    index = None
    if not every_row:
        index = to_device_async([row for row, _ in rows], logits.device)
    selected = logits if index is None else logits[index]
    masked = selected.masked_fill(disallowed, float("-inf"))
    if unsuppressed is not None:
        # Computed for every constrained row rather than asked for (no device-to-host sync).
        blocked = ~torch.isfinite(masked).any(dim=-1)
        before = unsuppressed if index is None else unsuppressed[index]
        fallback = before.masked_fill(disallowed, float("-inf"))
        masked = torch.where(blocked[:, None], fallback, masked)
    if index is None:
        return masked
    logits = logits.clone()
    logits[index] = masked
    return logits


def advance_matchers(
    rows: Sequence[ConstrainedRow], sampled: Sequence[int], work: GrammarWork
) -> None:
    """Feed each constrained row's sampled token to its matcher, its time and failure to
    work: a failed row's request must end with an error."""
    clock = time.perf_counter
    for row, matcher in rows:
        if row in work.faults:
            continue
        started = clock()
        try:
            if not matcher.consume_token(sampled[row]) or matcher.is_error():
                # Only a grammar past its limits gets here (the mask allowed the token).
                reason = (matcher.get_error().strip().splitlines() or ["matcher error"])[0]
                logger.warning("a grammar matcher failed: %s", reason)
                work.faults[row] = RequestFault(RequestErrorCode.GRAMMAR_LIMIT_EXCEEDED,
                                                f"grammar: {reason}")
        except BaseException as exc:
            _panic(row, exc, work)
        work.add_time(row, clock() - started)
