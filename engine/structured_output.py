"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some
strings, or a Lark grammar; checked once, before any engine work.

The constraint is enforced token by token with llguidance (engine.grammar_compiler compiles
it, engine.grammar_mask masks the logits). llguidance was chosen over xgrammar by measuring
both on the project's CPU machine with the default model's tokenizer (49,152 tokens) and the
ten benchmark schemas (ops/bench/inputs/structured-schemas.json): compile p50 0.5 ms / max
0.7 ms against xgrammar's 2.3 ms / 394 ms, a cached grammar's new matcher 0.01 ms against
0.12 ms, a mask 39 us a token on average against 14 us; and it needs nothing at run time
(xgrammar brings transformers, triton, pydantic and a TVM runtime into the server). Its
resource limits (lexer fuel, Earley items a step) bound what one tenant's grammar can cost
a step, which matters more in a shared engine than the mask's mean.

JSON is generated without free whitespace but with the separators most JSON a model has
read uses (`{"a": 1, "b": 2}`, json.dumps's): free whitespace lets a model spend its tokens on
blank space until max_tokens, and the compact form (`{"a":1}`) left SmolLM2-135M writing
digits without end at temperature 0 (`"population":1111...`) where `: ` gives it a number
it knows.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

if TYPE_CHECKING:  # a stub-only type
    from llguidance._lib import JsonCompileOptions

from engine.errors import InvalidRequestError

__all__ = [
    "JSON_OPTIONS",
    "MAX_STRUCTURED_SOURCE_CHARS",
    "StructuredOutput",
    "bounded_numbers",
    "grammar_limits",
]

# Longest schema, regex, grammar or list of choices a request may send (as JSON text).
MAX_STRUCTURED_SOURCE_CHARS = 32 << 10

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}


# Numbers the model writes: at most this many decimals and below this magnitude, where the
# schema sets no step or bound of its own (see bounded_numbers).
NUMBER_STEP = 1e-6
NUMBER_MAGNITUDE = 10**15
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "contains", "not", "if", "then", "else")


def bounded_numbers(schema: object) -> object:
    """The schema with a step and bounds on every number and integer that has none: at
    most 6 decimals, magnitude below 10**15 (exact in a double). Whatever the model writes
    still validates against the schema as given; what it cannot do is write digits until
    max_tokens, which SmolLM2-135M did at temperature 1.0 in 2 of 50 requests
    (`"score": 0.57236532073589615927...` for a number in [0, 1])."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(result.get(key), list):
            result[key] = [bounded_numbers(item) for item in result[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(result.get(key), dict):
            result[key] = {name: bounded_numbers(sub) for name, sub in result[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(result.get(key), dict):
            result[key] = bounded_numbers(result[key])
    kinds = result.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "number" in kinds or "integer" in kinds:
        if "number" in kinds and "multipleOf" not in result:
            result["multipleOf"] = NUMBER_STEP
        if "minimum" not in result and "exclusiveMinimum" not in result:
            result["minimum"] = -NUMBER_MAGNITUDE
        if "maximum" not in result and "exclusiveMaximum" not in result:
            result["maximum"] = NUMBER_MAGNITUDE
    return result


def grammar_limits() -> llguidance.LLParserLimits:
    """Bounds on one grammar's compilation and on each step's mask (llguidance's fuel):
    past them the grammar is refused (at validation) or the request ends with an error."""
    return llguidance.LLParserLimits(
        initial_lexer_fuel=1_000_000,  # about 20 ms of lexer construction
        step_lexer_fuel=200_000,  # about 15 ms of lexing a step
        step_max_items=50_000,  # about 2.5 ms of parsing a step
        max_grammar_size=200_000,
        verbose_errors=False,  # errors go to clients: no parser state in them
    )


@functools.lru_cache(maxsize=256)
def _grammar_error(kind: StructuredKind, source: str) -> str:
    """Why llguidance refuses a constraint ("" when it takes it); remembered, so a schema
    sent again is not checked again."""
    try:
        grammar = StructuredOutput(kind, source).grammar()
    except (ValueError, TypeError, RecursionError, GbnfToLarkError) as exc:
        return str(exc) or type(exc).__name__
    return llguidance.LLMatcher.validate_grammar(grammar, None, limits=grammar_limits())


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output. `source` is the schema (JSON text), the regex, the
    choices (a JSON array of strings) or the Lark grammar, as the kind says; `param` names
    the request field it came from, for errors."""

    kind: StructuredKind
    source: str = ""
    param: str = "response_format"

    @classmethod
    def json_schema(cls, schema: object, param: str) -> StructuredOutput:
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError("the schema must be a JSON object", param=param)
        return cls("json_schema", json.dumps(schema, separators=(",", ":")),
                   param)

    @classmethod
    def choice(cls, choices: object, param: str) -> StructuredOutput:
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise InvalidRequestError("choice must be a non-empty array of non-empty strings",
                                      param=param)
        return cls("choice", json.dumps(choices, separators=(",", ":")), param)

    def grammar(self) -> str:
        """The llguidance grammar of this constraint (not yet checked)."""
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(bounded_numbers(json.loads(self.source))), defaults=JSON_OPTIONS
            )
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            # JSON string literals are Lark string literals.
            alternatives = " | ".join(json.dumps(c) for c in json.loads(self.source))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        # llguidance's Lark, or GBNF (llama.cpp's, what vLLM's xgrammar backend takes).
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(self.source))

    def validate(self) -> None:
        """InvalidRequestError (naming the field) for a source too large, malformed, using a
        feature llguidance does not implement, or past the compile limits."""
        if len(self.source) > MAX_STRUCTURED_SOURCE_CHARS:
            raise InvalidRequestError(
                f"the {self.kind.replace('_', ' ')} holds {len(self.source)} characters; this "
                f"server takes at most {MAX_STRUCTURED_SOURCE_CHARS}",
                param=self.param,
            )
        error = _grammar_error(self.kind, self.source)
        if error:
            first_line = error.strip().splitlines()[0]
            raise InvalidRequestError(
                f"unsupported or invalid {self.kind.replace('_', ' ')}: {first_line}",
                param=self.param,
            )
