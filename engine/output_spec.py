"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some
strings, or a Lark grammar; checked once, before any engine work.

The constraint is enforced token by token with llguidance (engine.grammar_compiler compiles
it, engine.grammar_mask masks the logits). llguidance was chosen over xgrammar by measuring
both with the default model's tokenizer (49,152 tokens) and the ten benchmark schemas
(ops/bench/inputs/structured-schemas.json; ops/bench/journal.md, "Structured outputs: the
library, the mask, and what a constraint costs"): its compiles were faster, without
xgrammar's slow outlier, and so were a cached grammar's new matchers, though its masks were
slower on average; and it needs nothing at run time (xgrammar brings transformers, triton,
pydantic and a TVM runtime into the server). Its resource limits (lexer fuel, Earley items a
step) bound what one tenant's grammar can cost a step, which matters more in a shared engine
than the mask's mean.

A request's JSON schema compiles leniently (JSON_SCHEMA_OPTIONS): keywords llguidance does not
implement (`not`, `if`/`then`/`else`, `uniqueItems`, `unevaluatedProperties`, `contains`,
unknown formats...) are left out of the grammar and `oneOf` is read as `anyOf`, so the grammar
admits a superset of what the schema allows; the gateway checks each finished output against
the whole schema with a reference validator (gateway.openai.schema_check). Tool calls'
argument schemas compile strictly (JSON_OPTIONS): a keyword the grammar cannot enforce is
refused there.

JSON is generated without free whitespace but with the separators most JSON a model has
read uses (`{"a": 1, "b": 2}`, json.dumps's): free whitespace lets a model spend its tokens on
blank space until max_tokens, and the compact form (`{"a":1}`) left SmolLM2-135M writing
digits without end at temperature 0 (`"population":1111...`) where `: ` gives it a number
it knows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

if TYPE_CHECKING:  # a stub-only type
    from llguidance._lib import JsonCompileOptions

from engine.errors import InvalidRequestError

__all__ = [
    "JSON_OPTIONS",
    "JSON_SCHEMA_OPTIONS",
    "MAX_STRUCTURED_SOURCE_CHARS",
    "StructuredOutput",
    "bounded_numbers",
    "grammar_limits",
    "map_subschemas",
    "subschemas",
]

# Longest schema, regex, grammar or list of choices a request may send (as JSON text).
MAX_STRUCTURED_SOURCE_CHARS = 32 << 10

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}
# A request's JSON schema: what the grammar cannot enforce is left to the output's check.
JSON_SCHEMA_OPTIONS: JsonCompileOptions = {**JSON_OPTIONS, "lenient": True,
                                           "coerce_one_of": True}


# Numbers the model writes: at most this many decimals and below this magnitude, where the
# schema sets no step or bound of its own (see bounded_numbers).
NUMBER_STEP = 1e-6
NUMBER_MAGNITUDE = 10**15
# Where a schema's subschemas sit (Draft 2020-12): in lists, in maps by name, and alone. Every
# walk of a schema here and in the gateway goes through subschemas / map_subschemas, so none
# reads a value (const, enum, default, examples) as a schema.
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties",
                   "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "contains", "not", "if", "then", "else",
               "unevaluatedProperties", "unevaluatedItems", "propertyNames")
# Counts a schema may write as 2.0 (Draft 2020-12: an integer-valued number), which llguidance
# takes only as integers.
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
           "minContains", "maxContains")


def subschemas(schema: dict[str, object]) -> Iterator[tuple[str, object]]:
    """The schema's direct subschemas, each with its path from the schema (`.anyOf[0]`,
    `.properties.name`, `.items`)."""
    for key in _SUBSCHEMA_LISTS:
        if isinstance(items := schema.get(key), list):
            yield from ((f".{key}[{i}]", sub) for i, sub in enumerate(items))
    for key in _SUBSCHEMA_MAPS:
        if isinstance(named := schema.get(key), dict):
            yield from ((f".{key}.{name}", sub) for name, sub in named.items())
    for key in _SUBSCHEMAS:
        if isinstance(sub := schema.get(key), dict | bool):
            yield f".{key}", sub


def map_subschemas(schema: dict[str, object],
                   change: Callable[[object], object]) -> dict[str, object]:
    """A copy of the schema with change applied to each direct subschema."""
    result = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(items := result.get(key), list):
            result[key] = [change(sub) for sub in items]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(named := result.get(key), dict):
            result[key] = {name: change(sub) for name, sub in named.items()}
    for key in _SUBSCHEMAS:
        if isinstance(sub := result.get(key), dict | bool):
            result[key] = change(sub)
    return result


def bounded_numbers(schema: object) -> object:
    """The schema with a step and bounds on every number and integer that has none: at
    most 6 decimals, magnitude below 10**15 (exact in a double). Whatever the model writes
    still validates against the schema as given; what it cannot do is write digits until
    max_tokens, which SmolLM2-135M did at temperature 1.0 in 2 of 50 requests
    (`"score": 0.57236532073589615927...` for a number in [0, 1]). A number with a const or
    an enum is left alone (its values are given), and so is a bound or step the schema's own
    bounds would contradict (a range narrower than 0.001, a minimum past 10**15)."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = map_subschemas(schema, bounded_numbers)
    for key in _COUNTS:  # 2.0 is the count 2
        value = result.get(key)
        if isinstance(value, float) and value.is_integer() and value >= 0:
            result[key] = int(value)
    kinds = result.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if ("number" in kinds or "integer" in kinds) and "const" not in result \
            and "enum" not in result:
        low = _bound(result, "minimum", "exclusiveMinimum")
        high = _bound(result, "maximum", "exclusiveMaximum")
        wide = low is None or high is None or high - low >= 1e-3
        if "number" in kinds and "multipleOf" not in result and wide:
            result["multipleOf"] = NUMBER_STEP
        if low is None and (high is None or high > -NUMBER_MAGNITUDE):
            result["minimum"] = -NUMBER_MAGNITUDE
        if high is None and (low is None or low < NUMBER_MAGNITUDE):
            result["maximum"] = NUMBER_MAGNITUDE
    return result


def _bound(schema: dict[str, object], inclusive: str, exclusive: str) -> float | None:
    """A bound the schema sets (the inclusive or exclusive keyword), None without one."""
    values = [schema.get(inclusive), schema.get(exclusive)]
    numbers = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return numbers[0] if numbers else None


# Integers at or past this do not convert to a double (float() raises OverflowError).
_FLOAT_RANGE = 2**1024


def _check_numbers(schema: object, param: str) -> None:
    """InvalidRequestError naming the first number a double cannot hold (an infinity, NaN,
    an integer of 309 digits or more), with its path under param. Iterative: a schema is
    at most MAX_STRUCTURED_SOURCE_CHARS, but may nest deeper than Python recurses."""
    stack: list[tuple[object, str]] = [(schema, param)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            stack.extend((value, f"{path}.{key}") for key, value in item.items())
        elif isinstance(item, list):
            stack.extend((value, f"{path}[{index}]") for index, value in enumerate(item))
        elif (isinstance(item, float) and not math.isfinite(item)) or (
                isinstance(item, int) and not -_FLOAT_RANGE < item < _FLOAT_RANGE):
            raise InvalidRequestError(
                "the schema holds a number no double holds (numbers must be finite and below "
                "1.8e308)", param=path)


# Keywords whose subschemas annotate properties or items of the same object: where a schema
# has none, unevaluatedProperties / unevaluatedItems mean additionalProperties / items.
_APPLICATORS = ("allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "then", "else",
                "dependentSchemas")


def _closed_unevaluated(schema: object) -> object:
    """The schema with `unevaluatedProperties` read as `additionalProperties` (and
    `unevaluatedItems` as `items`) in each schema that has no applicator and no keyword of
    the other kind: there the two mean the same, and llguidance enforces the second (a
    lenient compile leaves the first out)."""
    if not isinstance(schema, dict):
        return schema
    result = map_subschemas(schema, _closed_unevaluated)
    if not any(key in result for key in _APPLICATORS):
        if "unevaluatedProperties" in result and "additionalProperties" not in result:
            result["additionalProperties"] = result.pop("unevaluatedProperties")
        if ("unevaluatedItems" in result and "items" not in result
                and "contains" not in result):
            result["items"] = result.pop("unevaluatedItems")
    return result


def _has_pattern_overlap(schema: object) -> bool:
    """Whether some object of the schema has two patternProperties or more (llguidance needs
    them disjoint)."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            patterns = item.get("patternProperties")
            if isinstance(patterns, dict) and len(patterns) > 1:
                return True
            stack.extend(sub for _, sub in subschemas(item))
    return False


def _merged_patterns(schema: object) -> object:
    """The schema with each object's patternProperties folded into additionalProperties as
    an anyOf of their schemas and the additional one: a superset (a property matching some
    patterns satisfies each, so one; any other satisfies additionalProperties), for a grammar
    llguidance takes where the patterns overlap; the finished output's check applies the
    schema as sent."""
    if not isinstance(schema, dict):
        return schema
    result = map_subschemas(schema, _merged_patterns)
    patterns = result.get("patternProperties")
    if isinstance(patterns, dict) and len(patterns) > 1:
        del result["patternProperties"]
        additional = result.get("additionalProperties", True)
        result["additionalProperties"] = {"anyOf": [*patterns.values(), additional]}
    return result


def grammar_limits() -> llguidance.LLParserLimits:
    """Bounds on one grammar's compilation and on each step's mask (llguidance's fuel):
    past them the grammar is refused (GrammarCompiler.check) or the request ends with an
    error."""
    return llguidance.LLParserLimits(
        initial_lexer_fuel=1_000_000,  # lexer construction (llguidance's default)
        step_lexer_fuel=200_000,  # lexing a step (llguidance's default)
        step_max_items=50_000,  # Earley items a step (llguidance's default)
        max_grammar_size=200_000,
        verbose_errors=False,  # errors go to clients: no parser state in them
    )


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output. `source` is the schema (JSON text), the regex, the
    choices (a JSON array of strings) or the Lark grammar, as the kind says; `param` names
    the request field it came from, for errors."""

    kind: StructuredKind
    source: str = ""
    param: str = "response_format"
    # A json_schema compiled leniently (JSON_SCHEMA_OPTIONS), its outputs checked against the
    # whole schema afterwards; else strictly (JSON_OPTIONS: a tool's parameters).
    lenient: bool = False

    @classmethod
    def json_schema(cls, schema: object, param: str, lenient: bool = False) -> StructuredOutput:
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError("the schema must be a JSON object", param=param)
        if schema is False:
            raise InvalidRequestError("the schema false matches no output", param=param)
        _check_numbers(schema, param)
        try:
            source = json.dumps(schema, separators=(",", ":"))
        except RecursionError:
            raise InvalidRequestError("the schema is nested too deeply", param=param) from None
        return cls("json_schema", source, param, lenient).check_size()

    @classmethod
    def choice(cls, choices: object, param: str) -> StructuredOutput:
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise InvalidRequestError("choice must be a non-empty array of non-empty strings",
                                      param=param)
        return cls("choice", json.dumps(choices, separators=(",", ":")), param).check_size()

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (not yet checked); InvalidRequestError
        for a source that cannot be read."""
        try:
            return self._grammar()
        except (ValueError, TypeError, RecursionError, GbnfToLarkError) as exc:
            raise InvalidRequestError(self.error_message(str(exc) or type(exc).__name__),
                                      param=self.param) from None

    def error_message(self, error: str) -> str:
        first_line = (error.strip().splitlines() or [""])[0]
        return f"unsupported or invalid {self.kind.replace('_', ' ')}: {first_line}"

    def _grammar(self) -> str:
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
        if self.kind == "json_schema":
            schema = bounded_numbers(json.loads(self.source))
            if schema is True:
                schema = {}
            if not self.lenient:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema), defaults=JSON_OPTIONS)
            schema = _closed_unevaluated(schema)
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=JSON_SCHEMA_OPTIONS)
            if _has_pattern_overlap(schema) and "not disjoint" in (
                    llguidance.LLMatcher.validate_grammar(grammar, limits=grammar_limits())):
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(_merged_patterns(schema)), defaults=JSON_SCHEMA_OPTIONS)
            return grammar
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            # JSON string literals are Lark string literals.
            alternatives = " | ".join(json.dumps(c) for c in json.loads(self.source))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        # llguidance's Lark, or GBNF (llama.cpp's, what vLLM's xgrammar backend takes).
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.source))

    def check_size(self) -> StructuredOutput:
        """Itself, or InvalidRequestError for a source over MAX_STRUCTURED_SOURCE_CHARS (the
        cheap check; whether llguidance takes it is GrammarCompiler.check's)."""
        if len(self.source) > MAX_STRUCTURED_SOURCE_CHARS:
            raise InvalidRequestError(
                f"the {self.kind.replace('_', ' ')} holds {len(self.source)} characters; this "
                f"server takes at most {MAX_STRUCTURED_SOURCE_CHARS}",
                param=self.param,
            )
        return self
