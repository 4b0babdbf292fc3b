"""Text of one sample as it grows: incremental detokenization, stop strings, and how much of
the text may be streamed (never a part of a stop string, never a broken character)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.sampling_params import SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.stop_strings import StopStringMatcher, StopStrings


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class TextOutputState:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._stops = (
            StopStringMatcher(StopStrings.of(tuple(params.stop))) if params.stop else None
        )
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        # The output text not handed out yet (cut before a matched stop string): the whole
        # text is never kept, so a long output costs no copy of itself per token.
        self._pending = ""
        self._num_chars = 0  # characters of the whole text, pending included
        self._finished = False
        self.stop_reason: str | None = None

    def append(self, new_token_ids: list[int], finished: bool) -> bool:
        """Add tokens; True when a stop string matched (the text is cut before it)."""
        if self._finished:
            return False
        delta = self._detokenizer.add_tokens(new_token_ids)
        if finished:
            delta += self._detokenizer.flush()
        self._finished = finished
        self._pending += delta
        self._num_chars += len(delta)
        match = self._stops.feed(delta) if self._stops is not None else None
        if match is not None:
            # A stop never reaches the stream: it starts within what is pending.
            self._pending = self._pending[: len(self._pending) - (self._num_chars - match.index)]
            self._num_chars = match.index
            self.stop_reason = match.stop
            self._finished = True
            return True
        return False

    def take_delta(self) -> str:
        """Text not handed out yet; holds back a tail that could begin a stop string."""
        pending = self._pending
        held = 0
        if not self._finished and self._stops is not None:
            held = min(self._stops.num_held_back_chars, len(pending))
        if not held:
            self._pending = ""
            return pending
        self._pending = pending[len(pending) - held:]
        return pending[: len(pending) - held]
