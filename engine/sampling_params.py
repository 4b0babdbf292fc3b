"""Per-request sampling parameters, validated once when the request enters the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.output_spec import StructuredOutput

# Temperatures below this are treated as greedy decoding.
GREEDY_EPSILON = 1e-5

# Longest stop string.
MAX_STOP_STRING_CHARS = 1024
# n x the characters of all stop strings: each sample keeps a match state per stop string
# and reads every new character against each (engine.stop_strings), so what a request may
# make the engine do a step is bounded across its samples.
MAX_STOP_CHARS_PER_REQUEST = 16 << 10
# Most stop token ids of one request; they are held as a set (a check per sampled token).
MAX_STOP_TOKEN_IDS = 1024


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Defaults follow the OpenAI API."""

    n: int = 1  # parallel samples of one prompt; they share the prompt's KV blocks
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus sampling mass, (0, 1]
    top_k: int = 0  # 0 disables; otherwise keep the k most likely tokens
    min_p: float = 0.0  # drop tokens below min_p * p(most likely token)
    repetition_penalty: float = 1.0  # HF-style multiplicative penalty over prompt+output tokens
    presence_penalty: float = 0.0  # OpenAI-style additive penalty, [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI-style additive penalty per occurrence, [-2, 2]
    seed: int | None = None  # same seed and inputs, same output
    max_tokens: int | None = None  # None: up to the model's context length
    min_tokens: int = 0  # EOS and stop token ids are suppressed before this many outputs
    stop: list[str] = field(default_factory=list)  # stop strings; not included in the output
    stop_token_ids: list[int] = field(default_factory=list)  # extra token ids that end the output
    ignore_eos: bool = False  # keep generating past the EOS token
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's plus top-k
    skip_special_tokens: bool = True  # drop special tokens from the detokenized text
    # The engine makes the text (RequestOutput.new_text). False: tokens only, the caller
    # detokenizes (the gateway does, off the engine's step); stop strings need the engine's.
    detokenize: bool = True
    # The output must match this (a JSON schema, a regex, ...); checked by the gateway
    # (GrammarCompiler.check) before it is sent, compiled by the engine (GrammarCompiler).
    structured: StructuredOutput | None = None
    # Derived once from stop_token_ids, for the checks made per sampled token: the ids as a
    # set (engine.stop_check), and sorted (what min_tokens suppresses, with EOS: the sampler).
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)
    sorted_stop_token_ids: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()
        self.stop_token_set = frozenset(self.stop_token_ids)
        self.sorted_stop_token_ids = tuple(sorted(self.stop_token_set))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field out of range."""
        checks: list[tuple[bool, str, str]] = [
            (1 <= self.n <= 128, "n", "n must be between 1 and 128"),
            (0.0 <= self.temperature <= 2.0, "temperature", "temperature must be in [0, 2]"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "top_k must be >= 0"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "repetition_penalty must be > 0"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                "presence_penalty",
                "presence_penalty must be in [-2, 2]",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty",
                "frequency_penalty must be in [-2, 2]",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                "max_tokens",
                "max_tokens must be >= 1",
            ),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "min_tokens must not exceed max_tokens",
            ),
            (self.detokenize or not self.stop, "stop", "stop strings need detokenize"),
            (
                len(self.stop) <= 16 and all(isinstance(s, str) and s for s in self.stop),
                "stop",
                "stop must be at most 16 non-empty strings",
            ),
            (
                all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
                "stop",
                f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters",
            ),
            (
                self.n * sum(len(s) for s in self.stop) <= MAX_STOP_CHARS_PER_REQUEST,
                "stop",
                f"n x the stop strings' characters must be at most "
                f"{MAX_STOP_CHARS_PER_REQUEST}",
            ),
            (
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                "stop_token_ids",
                f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids",
            ),
            (
                all(t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "stop_token_ids must be non-negative",
            ),
            (
                self.structured is None or not self.ignore_eos,
                "ignore_eos",
                "ignore_eos cannot be combined with a structured output: the grammar ends it",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                "logprobs",
                "logprobs must be in [0, 20]",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)
