"""Tokens and text: the tokenizer, incremental detokenization, stop strings, and the text
of one sample as it grows. Imports only the neutral modules.
"""

from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.stop_strings import StopStringMatcher, StopStrings
from engine.text.text_output import TextOutputState
from engine.text.tokenizer import Tokenizer

__all__ = [
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "StopStrings",
    "TextOutputState",
    "Tokenizer",
]
