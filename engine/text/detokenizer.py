"""Incremental detokenization: a growing list of token ids in, text deltas out.

Decoding one token at a time is wrong in two ways: a UTF-8 character can span several byte-level
tokens (each alone decodes to U+FFFD), and tokenizers such as SentencePiece render a token
differently depending on what precedes it (leading spaces). So, as in vLLM and TGI, the
detokenizer keeps two offsets into the token list: `prefix_offset` starts a short window of
already emitted tokens that gives the decoder its context, `read_offset` is where unemitted
tokens start. Each step decodes the window with and without the new tokens; the difference is
the delta, emitted only when it is non-empty and does not end in U+FFFD (an incomplete
character). The offsets then advance, so every step decodes only a few tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens kept as decoding context for the first output tokens (vLLM uses 5 as well).
NUM_PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs from engine.tokenizer.Tokenizer."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns the output tokens of one sequence into text, delta by delta."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        self._tokens: list[int] = context  # prompt context, then every output token
        self._num_context_tokens = len(context)
        self._prefix_offset = 0  # start of the decoding window (already emitted tokens)
        self._read_offset = len(context)  # first token whose text is not emitted yet
        self.text = ""  # all output text emitted so far

    @property
    def output_token_ids(self) -> list[int]:
        return self._tokens[self._num_context_tokens :]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens received whose text is held back (an incomplete character, so far)."""
        return len(self._tokens) - self._read_offset

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(
            self._tokens[start:end], skip_special_tokens=self._skip_special_tokens
        )

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append new output tokens; return the text they complete (possibly "")."""
        self._tokens.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing printable yet (a special token skipped, or a character still incomplete).
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence: emit held-back text even if it is an incomplete character.

        Its bytes then decode to U+FFFD, as a full decode of the output would show them.
        """
        if self._read_offset == len(self._tokens):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        delta = new_text[len(prefix_text) :]
        self.text += delta
        return delta
