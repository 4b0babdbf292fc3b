"""Structured outputs in the engine: constraint checks, the grammar cache, the sampler's mask,
and whole requests on the random-weight demo model (a mask must hold for any weights),
through preemption, parallel samples and aborts."""

from __future__ import annotations

import ctypes
import json
import re
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import pytest
import torch

from engine import (
    ConfigError,
    InvalidRequestError,
    LLMEngine,
    SamplingParams,
)
from engine.errors import RequestFault
from engine.grammar_budget import GrammarBudget
from engine.models.config import ModelConfig
from engine.output_spec import (
    MAX_STRUCTURED_SOURCE_CHARS,
    NUMBER_MAGNITUDE,
    NUMBER_STEP,
    StructuredOutput,
    bounded_numbers,
)
from engine.sample.sampler import Sampler
from engine.sample.seeded_noise import seeded_exponential
from engine.structured_output.fair_worker import FairWorker
from engine.structured_output.grammar_compiler import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarResult,
)
from engine.text.tokenizer import Tokenizer
from tests.engine.models.helpers import model_engine
from tests.serve_process import shared_demo_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "score"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def demo() -> tuple[Path, Tokenizer, ModelConfig]:
    path = shared_demo_model_dir()
    return path, Tokenizer.from_dir(path), ModelConfig.from_file(path)


def _compiler(demo: tuple[Path, Tokenizer, ModelConfig]) -> GrammarCompiler:
    _, tokenizer, config = demo
    assert tokenizer.eos_token_id is not None
    return GrammarCompiler(tokenizer, config.vocab_size, [tokenizer.eos_token_id])


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (StructuredOutput("json_schema", '{"type": "objectx"}'), "Invalid type"),
        (StructuredOutput("json_schema", '{"type": "object", "dependentSchemas": {}}'),
         "Unimplemented keys"),  # strict (a tool's parameters)
        (StructuredOutput("json_schema", '{"type": "object", "dependentSchemas": {}}',
                          lenient=True), ""),  # the rest is the finished output's check
        (StructuredOutput("json_schema", "[" * 5000), "nest|recurs|depth"),
        (StructuredOutput("regex", "a(b"), "invalid regex"),
        (StructuredOutput("grammar", "start: missing"), "unknown name"),
        (StructuredOutput("grammar", "root ::= ("), "Expected"),
        # Only the tokenizer knows it has no such token.
        (StructuredOutput("grammar", 'start: "a" <|no_such_token|>\n'), "token"),
        (StructuredOutput("json_schema", '{"type": "number", "const": 3.14159265}'), ""),
    ],
)
def test_constraints_are_checked_against_the_tokenizer(
    demo: tuple[Path, Tokenizer, ModelConfig], constraint: StructuredOutput, message: str
) -> None:
    compiler = _compiler(demo)
    if not message:  # a valid one, which the number bounds must not make unsatisfiable
        compiler.check(constraint)
        compiler.check(constraint)  # remembered
        return
    with pytest.raises(InvalidRequestError, match=message) as raised:
        compiler.check(constraint)
    assert raised.value.param == "response_format"
    with pytest.raises(GrammarError):  # the engine's compile fails the request, not itself
        compiler.compile(constraint).result()


def test_a_source_too_large_is_refused_before_it_is_read() -> None:
    with pytest.raises(InvalidRequestError, match="at most") as raised:
        StructuredOutput.json_schema({"description": "x" * MAX_STRUCTURED_SOURCE_CHARS}, "p")
    assert raised.value.param == "p"
    with pytest.raises(InvalidRequestError, match="nested too deeply"):
        deep: dict[str, object] = {}
        for _ in range(5000):
            deep = {"items": deep}
        StructuredOutput.json_schema(deep, "p")


def test_numbers_get_a_step_and_bounds_only_where_the_schema_has_none() -> None:
    schema = {"type": "object", "properties": {
        "a": {"type": "number"},
        "b": {"type": "integer", "minimum": 3},
        "c": {"type": ["number", "null"], "multipleOf": 0.5, "exclusiveMaximum": 9},
        "d": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
    }}
    bounded = bounded_numbers(schema)
    assert isinstance(bounded, dict)
    props = bounded["properties"]
    assert props["a"] == {"type": "number", "multipleOf": NUMBER_STEP,
                          "minimum": -NUMBER_MAGNITUDE, "maximum": NUMBER_MAGNITUDE}
    assert props["b"] == {"type": "integer", "minimum": 3, "maximum": NUMBER_MAGNITUDE}
    assert props["c"] == {"type": ["number", "null"], "multipleOf": 0.5, "exclusiveMaximum": 9,
                          "minimum": -NUMBER_MAGNITUDE}
    assert props["d"]["items"]["anyOf"][0]["maximum"] == NUMBER_MAGNITUDE
    assert schema["properties"]["a"] == {"type": "number"}  # the request's schema is kept
    given = {"type": "number", "enum": [0.1234567, 2]}
    assert bounded_numbers(given) == given  # its values are given: left alone
    assert bounded_numbers({"type": "integer", "minimum": 10**16}) == {
        "type": "integer", "minimum": 10**16}  # no maximum below its minimum
    narrow = {"type": "number", "minimum": 0.1234567, "maximum": 0.1234568}
    assert bounded_numbers(narrow) == narrow  # no step wider than its range


def test_seeded_noise_is_never_zero_at_the_top_of_its_range() -> None:
    # The key whose first output has the top 24 bits all set gave noise 0 in float32.
    noise = seeded_exponential(torch.arange(-(1 << 20), 1 << 20, 4096), 4096)
    assert bool((noise > 0).all())
    top = torch.tensor([(1 << 24) - 1], dtype=torch.float64)
    assert float(-torch.log((top + 0.5) / (1 << 24)).to(torch.float32)) > 0.0


def test_one_compile_serves_the_requests_waiting_for_it_per_tenant(
    demo: tuple[Path, Tokenizer, ModelConfig],
) -> None:
    compiler = _compiler(demo)
    constraint = StructuredOutput("regex", "[a-z]{1,8}")
    first, second = compiler.compile(constraint, "acme"), compiler.compile(constraint, "acme")
    other = compiler.compile(constraint, "globex")  # another tenant's salt: its own compile
    results = [f.result() for f in (first, second, other)]
    assert results[0].grammar is results[1].grammar
    assert results[0].compile_time_s > 0.0 and results[1].compile_time_s == 0.0
    assert results[2].grammar is not results[0].grammar
    assert compiler.num_compiled == 2
    hit = compiler.compile(constraint, "acme").result()
    assert (hit.grammar, hit.compile_time_s) == (results[0].grammar, 0.0)


def test_compiles_take_turns_between_tenants_and_are_charged_their_own_time(
    demo: tuple[Path, Tokenizer, ModelConfig],
) -> None:
    """A tenant with 40 compiles queued delays another tenant's first compile by one of
    them, and the other is charged its own compile's time, not its wait."""
    _, tokenizer, config = demo
    assert tokenizer.eos_token_id is not None
    worker = FairWorker("test-grammar")
    compiler = GrammarCompiler(tokenizer, config.vocab_size, [tokenizer.eos_token_id],
                               worker=worker)
    compiler.compile_now(StructuredOutput("regex", "warm"))  # the tokenizer's index
    gate = threading.Event()
    worker.submit("first", gate.wait)  # holds the thread while both tenants queue
    order: list[str] = []
    heavy = []
    for i in range(40):
        heavy.append(compiler.compile(StructuredOutput("regex", f"[a-z]{{{i},{i + 40}}}x"),
                                      "heavy"))
        heavy[-1].add_done_callback(lambda _, i=i: order.append(f"heavy{i}"))
    light = compiler.compile(StructuredOutput("regex", "[0-9]{4}"), "light")
    light.add_done_callback(lambda _: order.append("light"))
    time.sleep(0.3)  # a wait behind the others that its bill must not hold
    gate.set()
    assert light.result(timeout=60).compile_time_s < 0.2
    for future in heavy:
        future.result(timeout=60)
    assert order.index("light") == 1, order[:4]  # after heavy's first, not its fortieth


def test_one_tenants_schemas_do_not_evict_anothers_grammars(
    demo: tuple[Path, Tokenizer, ModelConfig],
) -> None:
    _, tokenizer, config = demo
    assert tokenizer.eos_token_id is not None
    compiler = GrammarCompiler(tokenizer, config.vocab_size, [tokenizer.eos_token_id],
                               cache_size=4)
    victim = StructuredOutput("regex", "[0-9]{3}")
    compiler.compile(victim, "victim").result(timeout=60)
    for i in range(30):
        compiler.compile(StructuredOutput("regex", f"a{{{i}}}"), "attacker").result(timeout=60)
    assert compiler.num_cached("attacker") == 4
    hit = compiler.compile(victim, "victim")
    assert hit.done() and hit.result().compile_time_s == 0.0  # still cached


def test_a_matcher_that_fails_ends_its_request_with_an_error() -> None:
    class FailingMatcher:
        """Allows every token, then refuses the one sampled (a grammar past its limits)."""

        def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
            ctypes.memset(pointer, 0xFF, size)

        def consume_token(self, token: int) -> bool:
            return False

        def is_error(self) -> bool:
            return True

        def get_error(self) -> str:
            return "step fuel exhausted"

    class Row:
        request_id = "r"
        sampling_params = SamplingParams(temperature=0.0, max_tokens=5)
        eos_token_id = None
        sample_index = 0
        penalty_counts = None
        json_closers = None
        num_output_tokens = 0

        def __init__(self) -> None:
            self.matcher = FailingMatcher()
            self.prompt_token_ids = [1]

        def output_tokens_since(self, start: int) -> list[int]:
            return []

    out = Sampler(64)(torch.randn(1, 64), [Row()])  # type: ignore[list-item]
    assert out.grammar_faults == {
        "r": RequestFault("grammar_limit_exceeded", "grammar: step fuel exhausted")}
    assert out.grammar_seconds["r"] > 0  # its mask and advance, timed


class PanicException(BaseException):
    """What a Rust panic inside llguidance surfaces as through pyo3 (a BaseException)."""


class _PanickingMatcher:
    """A matcher whose native code panics, in its mask or in its advance."""

    def __init__(self, where: str) -> None:
        self.where = where

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        if self.where == "mask":
            raise PanicException("index out of bounds")
        ctypes.memset(pointer, 0xFF, size)

    def consume_token(self, token: int) -> bool:
        raise PanicException("attempt to subtract with overflow")

    def is_error(self) -> bool:
        return False

    def deep_copy(self) -> _PanickingMatcher:
        return self


@pytest.mark.parametrize("where", ["mask", "advance"])
def test_a_panicking_matcher_fails_its_row_only(
    demo: tuple[Path, Tokenizer, ModelConfig], where: str
) -> None:
    _, tokenizer, config = demo
    good = _compiler(demo).compile_now(StructuredOutput("choice", '["yes", "no"]')).matcher()

    class Row:
        sampling_params = SamplingParams(temperature=0.0, max_tokens=5)
        eos_token_id = None
        sample_index = 0
        penalty_counts = None
        json_closers = None
        num_output_tokens = 0

        def __init__(self, request_id: str, matcher: object) -> None:
            self.request_id = request_id
            self.matcher = matcher
            self.prompt_token_ids = [1]

        def output_tokens_since(self, start: int) -> list[int]:
            return []

    rows = [Row("bad", _PanickingMatcher(where)), Row("good", good)]
    out = Sampler(config.vocab_size)(torch.randn(2, config.vocab_size), rows)  # type: ignore[arg-type]
    assert out.grammar_faults["bad"].code == "grammar_internal_error"
    assert "PanicException" in out.grammar_faults["bad"].message
    assert "good" not in out.grammar_faults
    first = tokenizer.decode([out.sampled_token_ids["good"]])
    assert first and ("yes".startswith(first) or "no".startswith(first)), first


def test_a_grammar_panic_ends_its_request_and_the_engine_goes_on(
    demo: tuple[Path, Tokenizer, ModelConfig],
) -> None:
    class PanickingCompiler(GrammarCompiler):
        def compile(self, constraint: StructuredOutput, salt: str = "") -> Future[GrammarResult]:
            done: Future[GrammarResult] = Future()
            done.set_result(GrammarResult(
                CompiledGrammar(constraint, _PanickingMatcher("mask")),  # type: ignore[arg-type]
                0.0))
            return done

    path, tokenizer, config = demo
    assert tokenizer.eos_token_id is not None
    engine = model_engine(path, num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=64,
                          async_scheduling=False, tokenizer=tokenizer,
                          grammars=PanickingCompiler(tokenizer, config.vocab_size,
                                                     [tokenizer.eos_token_id]))
    prompt = tokenizer.encode("hi")
    engine.add_request("bad", prompt, SamplingParams(
        max_tokens=5, structured=StructuredOutput("regex", "[0-9]{3}")))
    engine.add_request("plain", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert (finals["bad"].finish_reason, finals["bad"].error_code) == (
        "error", "grammar_internal_error")
    assert finals["plain"].finish_reason == "length" and finals["plain"].num_output_tokens == 5
    engine.add_request("after", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    assert _run(engine)[("after", 0)][2] == "length"


def test_a_grammar_past_its_budget_ends_with_a_clear_error_and_is_billed(
    demo: tuple[Path, Tokenizer, ModelConfig],
) -> None:
    """A budget no mask fits: the constrained request ends at its first token with
    grammar_budget_exceeded, its grammar time on its bill; the plain one in the same steps
    runs to its end."""
    engine = _engine(demo)
    engine.config.grammar_budget = GrammarBudget(max_mean_s_per_token=1e-9, num_free_tokens=1)
    prompt = demo[1].encode("hi")
    engine.add_request("costly", prompt, SamplingParams(
        max_tokens=50, structured=StructuredOutput("regex", "[a-z ]{1,200}")))
    engine.add_request("plain", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    costly = finals["costly"]
    assert (costly.finish_reason, costly.error_code) == ("error", "grammar_budget_exceeded")
    assert "a token on average" in (costly.error or "")
    assert costly.num_output_tokens == 1
    assert costly.metrics is not None
    assert 0 < costly.metrics.grammar_time_s <= costly.metrics.gpu_seconds
    assert finals["plain"].finish_reason == "length"
    # The grammar's time came out of the steps' time: the bills still add up to it.
    billed = sum(out.metrics.gpu_seconds for out in finals.values() if out.metrics is not None)
    assert billed == pytest.approx(engine.busy_time_s, rel=1e-9)


def test_grammar_budget_limits() -> None:
    budget = GrammarBudget(max_step_s=0.02, max_mean_s_per_token=0.002, num_free_tokens=32)
    assert budget.fault(0.019, 0.019, 1) is None
    fault = budget.fault(0.021, 0.021, 1)  # one step past its limit
    assert fault is not None and "for one token" in fault.message
    assert budget.fault(0.010, 0.063, 10) is None  # the first 32 tokens share 64 ms
    assert budget.fault(0.010, 0.065, 10) is not None
    assert budget.fault(0.001, 0.199, 100) is None  # 2 ms a token on average
    assert budget.fault(0.001, 0.201, 100) is not None
    with pytest.raises(ConfigError):
        GrammarBudget(max_step_s=0).validate()


def _engine(demo: tuple[Path, Tokenizer, ModelConfig], num_kv_blocks: int = 256,
            async_scheduling: bool = False, device: str = "cpu") -> LLMEngine:
    path, tokenizer, _ = demo
    assert tokenizer.eos_token_id is not None
    return model_engine(path, num_kv_blocks=num_kv_blocks, max_model_len=512,
                        max_num_batched_tokens=64, async_scheduling=async_scheduling,
                        device=device, tokenizer=tokenizer, grammars=_compiler(demo))


def _run(engine: LLMEngine) -> dict[tuple[str, int], tuple[str, list[int], str | None]]:
    texts: dict[tuple[str, int], str] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], str | None] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            key = (out.request_id, out.sample_index)
            texts[key] = texts.get(key, "") + out.new_text
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                reasons[key] = out.finish_reason
    return {key: (texts[key], tokens[key], reasons.get(key)) for key in texts}


def _requests(engine: LLMEngine, tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Tell me about a person.")
    schema = StructuredOutput.json_schema(SCHEMA, "response_format")
    email = StructuredOutput("regex", EMAIL)
    for seed in range(6):
        constraint = schema if seed % 2 == 0 else email
        engine.add_request(f"r{seed}", prompt, SamplingParams(
            temperature=1.0, seed=seed, max_tokens=120, structured=constraint,
            n=2 if seed == 1 else 1))
    engine.add_request("plain", prompt, SamplingParams(temperature=1.0, seed=9, max_tokens=30))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_random_weights_follow_the_constraint_through_preemption(
    demo: tuple[Path, Tokenizer, ModelConfig], async_scheduling: bool, device: str,
) -> None:
    """Async scheduling: a grammar's matcher takes each token before the next step's mask
    (sampling waits for the ids), and a request its grammar ended is computed a step past
    its end, with a finished matcher, and that token dropped. On CUDA (the device check,
    ops/gpu_check.sh) the masks travel to the device and apply there."""
    tokenizer = demo[1]
    roomy = _engine(demo, device=device)
    _requests(roomy, tokenizer)
    expected = _run(roomy)
    assert roomy.scheduler.num_preemptions_total == 0
    # preempts: resumed matchers replay the outputs
    tight = _engine(demo, num_kv_blocks=10, async_scheduling=async_scheduling, device=device)
    _requests(tight, tokenizer)
    outputs = _run(tight)
    assert tight.scheduler.num_preemptions_total > 0
    assert outputs == expected  # seeded: the same tokens however the batch ran
    assert len(outputs) == 8
    for (request_id, _), (text, _, reason) in outputs.items():
        if request_id == "plain":
            continue
        assert reason == "stop", (request_id, text)
        seed = int(request_id[1:])
        if seed % 2 == 0:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(EMAIL, text), text


def test_a_cached_grammar_costs_no_compile_and_an_abort_while_compiling_ends_the_request(
    demo: tuple[Path, Tokenizer, ModelConfig],
) -> None:
    engine = _engine(demo)
    prompt = demo[1].encode("hi")
    choice = StructuredOutput.choice(["yes", "no"], "structured_outputs.choice")
    engine.add_request("first", prompt, SamplingParams(max_tokens=5, structured=choice))
    engine.add_request("gone", prompt, SamplingParams(
        max_tokens=5, structured=StructuredOutput("regex", "[0-9]{3}")))
    engine.abort("gone")  # still compiling, or in the scheduler: either way it ends
    first = _run(engine)
    assert first[("gone", 0)][2] == "abort"
    assert first[("first", 0)][0] in ("yes", "no")
    assert engine.grammars is not None and engine.grammars.num_compiled >= 1
    engine.add_request("second", prompt, SamplingParams(max_tokens=5, structured=choice))
    compile_times = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.metrics is not None:
                compile_times.append(out.metrics.grammar_compile_s)
    assert compile_times == [0.0]
    assert engine.grammars.num_cache_hits == 1


def test_the_grammar_wins_over_min_tokens(demo: tuple[Path, Tokenizer, ModelConfig]) -> None:
    """min_tokens suppresses EOS, but a complete grammar allows nothing else: it ends."""
    _, tokenizer, config = demo
    compiler = _compiler(demo)
    grammar = compiler.compile_now(StructuredOutput("choice", '["ok"]'))
    matcher = grammar.matcher()
    assert matcher.consume_tokens(tokenizer.encode("ok", add_special_tokens=False))

    class Row:
        request_id = "r"
        sampling_params = SamplingParams(temperature=1.0, min_tokens=50, max_tokens=60)
        eos_token_id = tokenizer.eos_token_id
        sample_index = 0
        penalty_counts = None
        json_closers = None
        num_output_tokens = 1

        def __init__(self) -> None:
            self.matcher = matcher
            self.prompt_token_ids = [1, 2]

        def output_tokens_since(self, start: int) -> list[int]:
            return []

    sampler = Sampler(config.vocab_size, seed=0)
    out = sampler(torch.randn(1, config.vocab_size), [Row()])  # type: ignore[list-item]
    assert out.sampled_token_ids == {"r": tokenizer.eos_token_id}


def test_unevaluated_properties_are_enforced_where_they_mean_additional_properties(
    demo: tuple[Path, Tokenizer, ModelConfig],
) -> None:
    """A lenient compile leaves unevaluatedProperties / unevaluatedItems out; where no
    applicator evaluates properties or items beside them they mean additionalProperties /
    items, which the grammar then enforces. With an applicator, the check of the finished
    reply (gateway.openai.schema_check) is what holds them."""
    compiler, tokenizer = _compiler(demo), demo[1]

    def allows(schema: dict[str, object], text: str) -> bool:
        grammar = compiler.compile_now(StructuredOutput.json_schema(schema, "s", lenient=True))
        matcher = grammar.matcher()
        tokens = tokenizer.encode(text, add_special_tokens=False)
        # validate_tokens: how many of them the grammar takes in turn
        return matcher.validate_tokens(tokens) == len(tokens) and (
            matcher.consume_tokens(tokens) and matcher.is_accepting())

    closed = {"type": "object", "properties": {"a": {"type": "integer"}},
              "unevaluatedProperties": False}
    assert allows(closed, '{"a": 1}')
    assert not allows(closed, '{"a": 1, "b": 2}')
    with_applicator = {**closed, "allOf": [{"properties": {"b": {"type": "integer"}}}]}
    assert allows(with_applicator, '{"a": 1, "b": 2}')
    items = {"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False}
    assert allows(items, "[1]")
    assert not allows(items, "[1, 2]")
    data = {"const": {"unevaluatedProperties": False}}  # a value, not a schema: kept as is
    assert allows(data, '{"unevaluatedProperties": false}')
