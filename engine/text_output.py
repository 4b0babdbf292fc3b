"""Text of one sample as it grows: incremental detokenization, stop strings, and how much of
the text may be streamed (never a part of a stop string, never a broken character)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.stop_strings import find_stop_string, num_held_back_chars


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class TextOutputState:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self._stops = params.stop
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens
        )
        self.text = ""  # output text so far, cut before a matched stop string
        self._num_emitted = 0  # characters of text already handed out
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
        self.text += delta
        match = find_stop_string(self.text, len(delta), self._stops) if self._stops else None
        if match is not None:
            self.text = match.text
            self.stop_reason = match.stop
            self._finished = True
            return True
        return False

    def take_delta(self) -> str:
        """Text not handed out yet; holds back a tail that could begin a stop string."""
        end = len(self.text)
        if not self._finished and self._stops:
            end -= num_held_back_chars(self.text, self._stops)
        end = max(end, self._num_emitted)
        delta = self.text[self._num_emitted : end]
        self._num_emitted = end
        return delta
