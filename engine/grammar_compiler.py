"""GrammarCompiler: checks a request's StructuredOutput against the model's tokenizer, and
turns it into a matcher for the sampler off the engine step's critical path, keeping what it
compiled for the next request.

The gateway holds one to check constraints before any engine work (`check`: a 400 naming
the field for a schema llguidance refuses, a keyword it does not implement, a grammar past
its limits or naming tokens this tokenizer lacks); the engine holds another to compile them.
Compilation runs in a worker thread (llguidance drops the GIL while it builds a grammar):
the request waits for its grammar outside the scheduler, the step does not. Compiled
grammars are cached per tenant cache salt and constraint (a hit is a copy of the compiled
matcher, about 10 us here; the salt keeps one tenant from timing whether another used a
schema), and requests that need a grammar being compiled wait for that compile. Each
request is charged the compile time it caused (zero on a hit or a shared compile).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance

from engine.errors import InvalidRequestError
from engine.structured_output import StructuredOutput, grammar_limits
from engine.tokenizer import Tokenizer

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError", "GrammarResult"]

# Compiled grammars kept for later requests (least recently used dropped first).
DEFAULT_CACHE_SIZE = 256
# Constraints `check` remembers as good (a schema sent again is not checked again).
_CHECKED_SIZE = 1024


class GrammarError(Exception):
    """A constraint this compiler cannot turn into a matcher."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint: each request's sample takes its own matcher from it."""

    constraint: StructuredOutput
    _template: llguidance.LLMatcher  # never advanced; copied for each sample

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
    ) -> None:
        """vocab_size: the logits' width (the model's vocabulary); eos_token_ids: the tokens
        that may end a complete output (the engine's EOS first). The tokenizer's index
        (about 0.25 s for 49,152 tokens) is built on first use or by warm_up."""
        self._source = tokenizer
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_error: str | None = None
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple[str, StructuredOutput], CompiledGrammar] = OrderedDict()
        self._compiling: dict[tuple[str, StructuredOutput], Future[CompiledGrammar]] = {}
        self._checked: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.num_compiled = 0
        self.num_cache_hits = 0

    # -- the gateway's check ---------------------------------------------------------------

    def check(self, constraint: StructuredOutput) -> None:
        """InvalidRequestError (naming the constraint's field) unless llguidance takes the
        constraint with this tokenizer within its limits. Blocking (up to ~20 ms for a large
        schema): call it off the event loop."""
        key = (constraint.kind, constraint.source)
        with self._lock:
            if key in self._checked:
                self._checked.move_to_end(key)
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
            self._checked[key] = None
            while len(self._checked) > _CHECKED_SIZE:
                self._checked.popitem(last=False)

    # -- the engine's compile ----------------------------------------------------------------

    def compile(self, constraint: StructuredOutput, salt: str = "") -> Future[GrammarResult]:
        """The grammar of a constraint for a tenant (salt: its cache salt): done at once from
        the cache, else compiled in the worker thread (or awaited from the compile another
        request started). The future's exception is a GrammarError."""
        key = (salt, constraint)
        result: Future[GrammarResult] = Future()
        started = time.perf_counter()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                result.set_result(GrammarResult(cached, 0.0))
                return result
            shared = self._compiling.get(key)
            if shared is None:
                shared = self._compiling[key] = self._worker().submit(self._compile, key)
                charged = True
            else:
                charged = False

        def done(compiled: Future[CompiledGrammar]) -> None:
            error = compiled.exception()
            if error is not None:
                result.set_exception(error)
                return
            seconds = time.perf_counter() - started if charged else 0.0
            result.set_result(GrammarResult(compiled.result(), seconds))

        shared.add_done_callback(done)
        return result

    def compile_now(self, constraint: StructuredOutput, salt: str = "") -> CompiledGrammar:
        """Compile in the calling thread (and cache)."""
        return self._compile((salt, constraint))

    def warm_up(self) -> None:
        """Build the tokenizer's index in the worker thread now, not on the first request."""
        self._worker().submit(self._warm_up)

    def _warm_up(self) -> None:
        with contextlib.suppress(GrammarError):  # remembered: every constraint refused with it
            self._llg_tokenizer()

    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tiergate-grammar")
        return self._executor

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
        except Exception as exc:  # anything llguidance raises fails the request, not the engine
            with self._lock:
                self._compiling.pop(key, None)
            if isinstance(exc, GrammarError):
                raise
            raise GrammarError(f"{type(exc).__name__}: {exc}") from exc
        grammar = CompiledGrammar(constraint, matcher)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            self._compiling.pop(key, None)
        return grammar
