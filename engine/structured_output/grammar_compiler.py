"""GrammarCompiler: checks a request's StructuredOutput against the model's tokenizer, and
turns it into a matcher for the sampler off the engine step's critical path, keeping what it
compiled for the next request.

The gateway holds one to check constraints before any engine work (`check`: a 400 naming
the field for a schema llguidance refuses, a keyword it does not implement, a grammar past
its limits or naming tokens this tokenizer lacks); the engine holds another to compile them.
Compilation runs in a worker thread (llguidance drops the GIL while it builds a grammar):
the request waits for its grammar outside the scheduler, the step does not. The worker
takes its jobs in turns between tenants (engine.fair_worker): a tenant queuing many
compiles delays another tenant's by one compile at most. Compiled grammars are cached per
tenant cache salt and constraint, in a partition per tenant (engine.partitioned_lru: a
tenant sending many distinct schemas evicts only its own; a hit is a copy of the compiled
matcher, far cheaper than a compile; the salt keeps one tenant from timing whether another
used a schema), and requests that need a grammar being compiled wait for that compile. Each
request is charged the compile time it caused (the compile's own time: zero on a hit or a
shared compile, and never the time it waited behind other tenants' compiles). The
gateway's checks go through the same turns (`check_async`), and are remembered per
tenant too.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import llguidance
import numpy as np

from engine.errors import InvalidRequestError, is_fatal
from engine.output_spec import StructuredOutput, grammar_limits
from engine.structured_output.closing_tokens import closing_token_ids
from engine.structured_output.fair_worker import FairWorker
from engine.structured_output.partitioned_lru import PartitionedLru
from engine.text.tokenizer import Tokenizer

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError", "GrammarResult"]

# Compiled grammars kept for later requests, per tenant (least recently used dropped first),
# for this many tenants at most.
DEFAULT_CACHE_SIZE = 64
MAX_CACHED_TENANTS = 64
# Constraints `check` remembers as good per tenant (a schema sent again is not checked again).
_CHECKED_SIZE = 256
# The key of the compiler's own jobs (the tokenizer's index) in the worker's turns.
_OWN_KEY = "\x00tiergate"


class GrammarError(Exception):
    """A constraint this compiler cannot turn into a matcher."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint: each request's sample takes its own matcher from it."""

    constraint: StructuredOutput
    _template: llguidance.LLMatcher  # never advanced; copied for each sample
    # A JSON constraint's tokens that only close what is open (engine.sample.closing_nudge);
    # None for other kinds.
    closing_ids: np.ndarray | None = None

    def matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


@dataclass(frozen=True)
class GrammarResult:
    """What a request waited for: the grammar, and the compile time it is charged."""

    grammar: CompiledGrammar
    compile_time_s: float  # 0.0 when the grammar came from the cache or another's compile


class GrammarCompiler:
    """Checks and compiles constraints against one tokenizer."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
        worker: FairWorker | None = None,
    ) -> None:
        """vocab_size: the logits' width (the model's vocabulary); eos_token_ids: the tokens
        that may end a complete output (the engine's EOS first); cache_size: compiled grammars
        kept per tenant; worker: the thread compiles and checks run in (its own if None).
        The tokenizer's index (about 0.25 s for 49,152 tokens) is built on
        first use or by warm_up."""
        self._source = tokenizer
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self.vocab_size = vocab_size
        self._cache: PartitionedLru[StructuredOutput, CompiledGrammar] = PartitionedLru(
            cache_size, MAX_CACHED_TENANTS)
        self._compiling: dict[tuple[str, StructuredOutput],
                              Future[tuple[CompiledGrammar, float]]] = {}
        self._checked: PartitionedLru[tuple[str, bool, str], bool] = PartitionedLru(
            _CHECKED_SIZE, MAX_CACHED_TENANTS)
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._closing: np.ndarray | None = None
        self._worker = worker or FairWorker("tiergate-grammar")
        self.num_compiled = 0
        self.num_cache_hits = 0

    # -- the gateway's check ---------------------------------------------------------------

    def check(self, constraint: StructuredOutput, salt: str = "") -> None:
        """InvalidRequestError (naming the constraint's field) unless llguidance takes the
        constraint with this tokenizer within its limits. Blocking (a large schema's check
        takes as long as its compile): call it off the event loop, or through check_async.
        salt: the tenant's cache salt (what it remembers as good is the tenant's)."""
        key = (constraint.kind, constraint.lenient, constraint.source)
        with self._lock:
            if self._checked.get(salt, key):
                return
        grammar = constraint.grammar()
        try:
            tokenizer = self._llg_tokenizer()
        except GrammarError as exc:
            raise InvalidRequestError(str(exc), param=constraint.param) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=grammar_limits())
        if error:
            raise InvalidRequestError(constraint.error_message(error), param=constraint.param)
        with self._lock:
            self._checked.put(salt, key, True)

    def check_async(self, constraints: list[StructuredOutput], salt: str) -> Future[None]:
        """check each constraint in the worker thread, in the tenant's turn (salt: its cache
        salt); the future fails with the first InvalidRequestError."""

        def check_all() -> None:
            for constraint in constraints:
                self.check(constraint, salt)

        return self._worker.submit(salt, check_all)

    # -- the engine's compile ----------------------------------------------------------------

    def compile(self, constraint: StructuredOutput, salt: str = "") -> Future[GrammarResult]:
        """The grammar of a constraint for a tenant (salt: its cache salt): done at once from
        the cache, else compiled in the worker thread (or awaited from the compile another
        request started). The future's exception is a GrammarError."""
        key = (salt, constraint)
        result: Future[GrammarResult] = Future()
        with self._lock:
            cached = self._cache.get(salt, constraint)
            if cached is not None:
                self.num_cache_hits += 1
                result.set_result(GrammarResult(cached, 0.0))
                return result
            shared = self._compiling.get(key)
            if shared is None:
                shared = self._compiling[key] = self._worker.submit(
                    salt, lambda: self._timed_compile(key))
                charged = True
            else:
                charged = False

        def done(compiled: Future[tuple[CompiledGrammar, float]]) -> None:
            error = compiled.exception()
            if error is not None:
                result.set_exception(error)
                return
            grammar, seconds = compiled.result()
            result.set_result(GrammarResult(grammar, seconds if charged else 0.0))

        shared.add_done_callback(done)
        return result

    def compile_now(self, constraint: StructuredOutput, salt: str = "") -> CompiledGrammar:
        """Compile in the calling thread (and cache)."""
        return self._compile((salt, constraint))

    def num_cached(self, salt: str) -> int:
        """Compiled grammars kept for the tenant of this cache salt."""
        with self._lock:
            return self._cache.num_entries(salt)

    def warm_up(self) -> None:
        """Build the tokenizer's index in the worker thread now, not on the first request."""
        self._worker.submit(_OWN_KEY, self._warm_up)

    def _warm_up(self) -> None:
        with contextlib.suppress(GrammarError):  # remembered: every constraint refused with it
            self._llg_tokenizer()

    def _timed_compile(self, key: tuple[str, StructuredOutput]) -> tuple[CompiledGrammar, float]:
        started = time.perf_counter()
        grammar = self._compile(key)
        return grammar, time.perf_counter() - started

    def _closing_ids(self) -> np.ndarray:
        """The vocabulary's closing tokens (closing_nudge), found once (tens of ms)."""
        with self._tokenizer_lock:
            if self._closing is None:
                texts = [self._source.decode([i], skip_special_tokens=False)
                         for i in range(self.vocab_size)]
                self._closing = closing_token_ids(texts)
            return self._closing

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None and self._tokenizer_error is None:
                try:
                    self._tokenizer = llguidance.LLTokenizer(
                        self._source.to_json(), n_vocab=self.vocab_size,
                        eos_token=self._eos_token_ids or None,
                    )
                except (ValueError, TypeError) as exc:
                    self._tokenizer_error = (
                        f"this model's tokenizer cannot serve structured outputs: {exc}")
            if self._tokenizer is None:
                raise GrammarError(self._tokenizer_error)
            return self._tokenizer

    def _compile(self, key: tuple[str, StructuredOutput]) -> CompiledGrammar:
        constraint = key[1]
        try:
            matcher = llguidance.LLMatcher(
                self._llg_tokenizer(), constraint.grammar(), log_level=0,
                limits=grammar_limits(),
            )
            if matcher.is_error():
                raise GrammarError(constraint.error_message(matcher.get_error()))
        except BaseException as exc:  # anything llguidance raises (a panic too) fails the
            with self._lock:          # request, not the engine
                self._compiling.pop(key, None)
            if isinstance(exc, GrammarError) or is_fatal(exc):
                raise
            raise GrammarError(f"{type(exc).__name__}: {exc}") from exc
        closing = (self._closing_ids() if constraint.kind in ("json_schema", "json_object")
                   else None)
        grammar = CompiledGrammar(constraint, matcher, closing)
        with self._lock:
            self.num_compiled += 1
            self._cache.put(key[0], constraint, grammar)
            self._compiling.pop(key, None)
        return grammar
