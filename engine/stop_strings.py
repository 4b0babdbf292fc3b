"""Stop strings over streamed text: find them across token boundaries, never stream part of one.

Detokenized text grows by deltas that rarely line up with a stop string: "</an" + "swer>" must
match "</answer>". `find_stop_string` looks for occurrences that end inside the newest delta (any
occurrence that ended earlier was found on an earlier call) and returns the text cut before
the earliest one. `num_held_back_chars` says how much of the tail to keep unstreamed because it
could be the start of a stop string that the next delta completes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StopMatch", "find_stop_string", "num_held_back_chars"]


@dataclass(frozen=True)
class StopMatch:
    """A stop string found in the output text."""

    text: str  # the output text up to the stop string, which is not included
    stop: str  # the stop string that matched (the request's stop_reason)
    index: int  # where it starts in the full text; equals len(text)


def find_stop_string(text: str, num_new_chars: int, stops: Sequence[str]) -> StopMatch | None:
    """The earliest stop string occurrence that ends within the last `num_new_chars` of `text`.

    `text` is the whole output so far, its last `num_new_chars` characters the newest delta.
    An occurrence may start before the delta (it spans the boundary). Among occurrences at the
    same position the first in `stops` wins.
    """
    if num_new_chars <= 0:
        return None
    old_len = len(text) - num_new_chars
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        # Occurrences starting here or later end after old_len, so inside the new text.
        index = text.find(stop, max(0, old_len - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    index, stop = best
    return StopMatch(text=text[:index], stop=stop, index=index)


def num_held_back_chars(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string.

    A streaming response sends `text[: len(text) - num_held_back_chars(text, stops)]` so far;
    when the sequence finishes without a match the held-back tail is sent as well.
    """
    held = 0
    end = len(text)
    for stop in stops:
        if not stop:
            continue
        # Longest k < len(stop) with text ending in stop[:k], only k > held improving: such a
        # tail starts at a copy of stop's first character, so only those are tried, longest
        # first (a C-level find; testing every k with a slice was quadratic in the stop).
        first = stop[0]
        start = text.find(first, max(0, end - len(stop) + 1), end - held)
        while start != -1:
            if stop.startswith(text[start:]):
                held = end - start
                break
            start = text.find(first, start + 1, end - held)
    return held
