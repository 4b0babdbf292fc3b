"""Text of one sample as it grows: detokenization, stop strings, and what may be streamed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.sampling_params import SamplingParams


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class TextOutputState:
    """Builds the output text of one sample and finds stop strings across token boundaries."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._tokenizer = tokenizer
        self._params = params
        self._token_ids: list[int] = []
        self.text = ""  # the output text so far (truncated before a matched stop string)
        self._num_emitted = 0  # characters of text already handed out
        self._finished = False
        self.stop_reason: str | None = None

    def append(self, new_token_ids: list[int], finished: bool) -> bool:
        """Add tokens; True when a stop string matched (the text is cut before it)."""
        self._token_ids.extend(new_token_ids)
        previous_len = len(self.text)
        text = self._tokenizer.decode(
            self._token_ids, skip_special_tokens=self._params.skip_special_tokens
        )
        self._finished = finished
        if not finished:
            # A multi-byte character split across tokens decodes to U+FFFD: wait for the rest.
            text = text.rstrip("\ufffd")
        search_from = max(0, previous_len - max((len(s) for s in self._params.stop), default=0))
        match = _earliest_stop(text, self._params.stop, search_from)
        if match is not None:
            index, stop = match
            self.text = text[:index]
            self.stop_reason = stop
            self._finished = True
            return True
        self.text = text
        return False

    def take_delta(self) -> str:
        """Text not handed out yet; holds back a tail that could begin a stop string."""
        end = len(self.text)
        if not self._finished:
            end -= _partial_stop_len(self.text, self._params.stop)
        end = max(end, self._num_emitted)
        delta = self.text[self._num_emitted : end]
        self._num_emitted = end
        return delta


def _earliest_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, search_from)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
