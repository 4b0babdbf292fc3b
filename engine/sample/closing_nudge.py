"""A JSON reply near its max_tokens is nudged towards closing what it has open.

A constrained reply that runs out of tokens ends unfinished (`finish_reason: "length"`): its
JSON does not parse. Most such replies of a small model are a string or an array that goes on
(ops/bench/journal.md, "JSON schemas as people send them"). In the last tokens of its budget
(a quarter of max_tokens, at most CLOSE_WINDOW), each token that only closes (`"`, `]`, `}`
and their runs: engine.structured_output.closing_tokens, carried by the row) gets a logit
bias that grows to CLOSE_BIAS at the last token, before the grammar's mask: the grammar still
decides what is allowed (a string shorter than its minLength cannot close), no value the
schema allows is refused, and a reply with room to finish is never touched. Only rows whose
constraint is JSON carry closing tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["CLOSE_BIAS", "CLOSE_WINDOW", "close_window", "nudge_towards_closing"]

CLOSE_WINDOW = 48  # most tokens before max_tokens where the nudge starts
CLOSE_BIAS = 8.0  # the logit bias at the last token (a linear ramp from 0 before it)
def close_window(max_tokens: int) -> int:
    """The tokens before max_tokens where a reply is nudged: a quarter of its budget, at
    most CLOSE_WINDOW (a short reply is left alone for its first three quarters)."""
    return min(CLOSE_WINDOW, max_tokens // 4)


def nudge_towards_closing(logits: torch.Tensor,
                          rows: Sequence[tuple[int, int, int, np.ndarray]]) -> torch.Tensor:
    """logits with each (row, tokens left, max_tokens, closing ids) row's closing tokens
    raised, when tokens left (1: the last token) is within close_window(max_tokens); a copy
    where any row changes."""
    chosen = [(row, left, window, ids) for row, left, limit, ids in rows
              if 0 < left <= (window := close_window(limit)) and ids.size]
    if not chosen:
        return logits
    logits = logits.clone()
    for row, left, window, ids in chosen:
        bias = CLOSE_BIAS * (window + 1 - left) / window
        columns = torch.from_numpy(ids).to(logits.device, non_blocking=True)
        logits[row].index_add_(0, columns, torch.full((ids.size,), bias, dtype=logits.dtype,
                                                      device=logits.device))
    return logits
