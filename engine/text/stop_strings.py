"""Stop strings over streamed text: found across token boundaries, never part of one streamed.

Detokenized text grows by deltas that rarely line up with a stop string: "</an" + "swer>" must
match "</answer>". Each sample keeps, per stop string, how much of the stop string the text
now ends with (the Knuth-Morris-Pratt automaton's state), and reads each new character once
against each: the work per step is the new characters times the stop strings, whatever their
length and whatever the text so far. (Searching the text's tail for every stop string and
testing every place a stop string could begin cost work that grew with the stop strings'
length every step, which long stop strings and a tail written to nearly match them turned
into an attack: ops/bench/journal.md, "Costly but valid requests".)

The earliest occurrence wins (among occurrences at the same place, the first in the
request's list), and the state's largest value is how much of the text's end to hold back
from the stream: it could begin a stop string that the next delta completes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["StopMatch", "StopStringMatcher", "StopStrings"]


@dataclass(frozen=True)
class StopMatch:
    """A stop string found in the output text."""

    stop: str  # the stop string that matched (the request's stop_reason)
    index: int  # where it starts in the whole text: the text is cut there


class StopStrings:
    """A request's stop strings with their failure tables, shared by its samples."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.failures = tuple(_failure_table(stop) for stop in self.stops)

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(stops: tuple[str, ...]) -> StopStrings:
        """The tables of these stop strings (built once for a request's n samples, and for
        requests that send the same ones)."""
        return StopStrings(stops)


def _failure_table(stop: str) -> list[int]:
    """failure[k]: the longest proper prefix of stop[:k + 1] that is also its suffix."""
    failure = [0] * len(stop)
    length = 0
    for position in range(1, len(stop)):
        while length and stop[position] != stop[length]:
            length = failure[length - 1]
        if stop[position] == stop[length]:
            length += 1
        failure[position] = length
    return failure


class StopStringMatcher:
    """One sample's stop-string state over its text as the text grows."""

    def __init__(self, strings: StopStrings) -> None:
        self._strings = strings
        self._states = [0] * len(strings.stops)  # characters of each stop the text ends with
        self._num_chars = 0  # characters read so far

    def feed(self, delta: str) -> StopMatch | None:
        """Read the text's next characters; the earliest stop string that ends within them,
        if any (an occurrence may start before the delta)."""
        best: tuple[int, int] | None = None  # (start, index of the stop)
        states = self._states
        for k, stop in enumerate(self._strings.stops):
            failure = self._strings.failures[k]
            state = states[k]
            last = len(stop)
            for offset, char in enumerate(delta):
                while state and stop[state] != char:
                    state = failure[state - 1]
                if stop[state] == char:
                    state += 1
                    if state == last:  # this stop's first occurrence in the delta
                        start = self._num_chars + offset + 1 - last
                        if best is None or start < best[0]:
                            best = (start, k)
                        break
            states[k] = state
        self._num_chars += len(delta)
        if best is None:
            return None
        return StopMatch(self._strings.stops[best[1]], best[0])

    @property
    def num_held_back_chars(self) -> int:
        """The length of the longest end of the text that begins a stop string (and is not
        a whole one: that would have matched)."""
        return max(self._states, default=0)
