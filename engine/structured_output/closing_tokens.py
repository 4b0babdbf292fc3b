"""The tokens of a vocabulary that only close a JSON value (`"`, `]`, `}` and their runs):
what the sampler nudges a JSON reply towards at the end of its budget
(engine.sample.closing_nudge). Found once per grammar compiler (tens of ms)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["closing_token_ids"]

_CLOSERS = frozenset('"]}')


def closing_token_ids(token_texts: Sequence[str]) -> np.ndarray:
    """The ids of the tokens whose text, spaces aside, is only `"`, `]` and `}`."""
    ids = [i for i, text in enumerate(token_texts)
           if (stripped := text.strip(" ")) and set(stripped) <= _CLOSERS]
    return np.asarray(ids, dtype=np.int64)
