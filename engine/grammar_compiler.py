"""GrammarCompiler: turns a request's StructuredOutput into a matcher for the sampler, off the
engine step's critical path, and keeps what it compiled for the next request.

Compilation runs in a worker thread (llguidance drops the GIL while it builds a grammar):
the request waits for its grammar outside the scheduler, the step does not. Compiled
grammars are cached by constraint (the tokenizer is the engine's, one per compiler), shared
across requests and tenants: a grammar holds no request's data, only the schema, and a cache
hit costs a copy of the compiled matcher (about 10 us here). Each request is charged the
compile time it waited for (zero on a hit) on its usage record.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance

from engine.structured_output import StructuredOutput, grammar_limits

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarError"]

# Compiled grammars kept for later requests (least recently used dropped first).
DEFAULT_CACHE_SIZE = 256


class GrammarError(Exception):
    """A grammar the matcher refused (past its limits with this tokenizer)."""


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
    compile_time_s: float  # 0.0 when the grammar came from the cache


class GrammarCompiler:
    """Compiles constraints against one tokenizer (its HF `tokenizers` JSON), caching them."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: list[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        """vocab_size: the logits' width (the model's vocabulary); eos_token_ids: the tokens
        that may end a complete output (the engine's EOS first). The tokenizer's index
        (about 0.25 s for 49,152 tokens) is built by the first compile or by warm_up."""
        self._tokenizer_json = tokenizer_json
        self._eos_token_ids = eos_token_ids
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.vocab_size = vocab_size
        self._cache: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self.num_compiled = 0
        self.num_cache_hits = 0

    def compile(self, constraint: StructuredOutput) -> Future[GrammarResult]:
        """The grammar of a constraint: done at once from the cache, else compiled in the
        worker thread. The future's exception is a GrammarError for a grammar this tokenizer
        cannot take."""
        with self._lock:
            cached = self._cache.get(constraint)
            if cached is not None:
                self._cache.move_to_end(constraint)
                self.num_cache_hits += 1
        if cached is not None:
            done: Future[GrammarResult] = Future()
            done.set_result(GrammarResult(cached, 0.0))
            return done
        return self._worker().submit(self.compile_now, constraint)

    def warm_up(self) -> None:
        """Build the tokenizer's index in the worker thread now, not on the first request."""
        self._worker().submit(self._llg_tokenizer)

    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tiergate-grammar")
        return self._executor

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size,
                    eos_token=self._eos_token_ids or None,
                )
            return self._tokenizer

    def compile_now(self, constraint: StructuredOutput) -> GrammarResult:
        """Compile in the calling thread (and cache)."""
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(
            self._llg_tokenizer(), constraint.grammar(), log_level=0, limits=grammar_limits()
        )
        if matcher.is_error():
            raise GrammarError(matcher.get_error().strip().splitlines()[0])
        grammar = CompiledGrammar(constraint, matcher)
        elapsed = time.perf_counter() - started
        with self._lock:
            self.num_compiled += 1
            self._cache[constraint] = grammar
            self._cache.move_to_end(constraint)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return GrammarResult(grammar, elapsed)
