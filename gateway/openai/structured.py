"""The request fields that constrain a reply: response_format, vLLM's structured_outputs
(and its older guided_* names), and tools with tool_choice; read into engine constraints
and tool lists, each problem a 400 naming its field.

These checks are cheap (shape and size: at most 32 KiB a constraint, 64 KiB for all of one
request's); whether llguidance takes each one with the model's tokenizer is checked in a
worker thread before any engine work (gateway.openai.generation.check_constraints).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine import InvalidRequestError, StructuredOutput, subschemas
from gateway.http.errors import BadRequestError
from gateway.openai.tool_calls import FunctionTool, ToolChoice

MAX_TOOLS = 128
# All the schemas, grammars and tool parameters of one request together, as JSON text.
MAX_REQUEST_CONSTRAINT_CHARS = 64 << 10
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# vLLM's extension fields (the SDK's extra_body); structured_outputs is the current one.
STRUCTURED_FIELDS = frozenset(
    {"structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
)
_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar", "json_object": "json_object"}


@dataclass(frozen=True)
class ToolRequest:
    """The tools a chat request offers and what it asks of them."""

    tools: tuple[FunctionTool, ...]
    choice: ToolChoice
    parallel: bool  # parallel_tool_calls
    # Each tool's parameters as a constraint (checked like a response_format schema: a
    # forced call's arguments are constrained by them).
    parameter_constraints: tuple[StructuredOutput, ...] = ()

    @property
    def is_active(self) -> bool:
        """Tools are rendered and calls parsed (tool_choice is not "none")."""
        return bool(self.tools) and self.choice.mode != "none"


NO_TOOLS = ToolRequest((), ToolChoice("none"), True)


def _invalid(message: str, param: str) -> BadRequestError:
    return BadRequestError(message, param=param)


def _constraint(build: Any, *args: Any) -> StructuredOutput:
    """The constraint build(*args) makes, its size checked."""
    try:
        constraint: StructuredOutput = build(*args)
        return constraint.check_size()
    except InvalidRequestError as exc:
        raise _invalid(str(exc), exc.param or "response_format") from exc


def check_total_size(constraints: list[StructuredOutput]) -> None:
    """400 when one request's constraints hold more than MAX_REQUEST_CONSTRAINT_CHARS."""
    total = sum(len(c.source) for c in constraints)
    if total > MAX_REQUEST_CONSTRAINT_CHARS:
        raise _invalid(
            f"the request's schemas and grammars hold {total} characters; this server takes "
            f"at most {MAX_REQUEST_CONSTRAINT_CHARS} in one request",
            constraints[-1].param,
        )


def structured_output(
    response_format: object, extensions: dict[str, object]
) -> StructuredOutput | None:
    """The constraint of response_format or of one vLLM extension field; at most one."""
    found: list[StructuredOutput] = []
    if response_format is not None:
        constraint = _response_format(response_format)
        if constraint is not None:
            found.append(constraint)
    for name, value in extensions.items():
        if value is None:
            continue
        if name == "structured_outputs":
            found.append(_structured_outputs(value))
        elif name == "guided_json":
            found.append(_json_schema(value, name))
        elif name == "guided_choice":
            found.append(_constraint(StructuredOutput.choice, value, name))
        else:  # guided_regex, guided_grammar
            found.append(_text_source("regex" if name == "guided_regex" else "grammar",
                                      value, name))
    if len(found) > 1:
        raise _invalid("give at most one of response_format, structured_outputs and guided_*",
                       param=found[1].param)
    return found[0] if found else None


def _response_format(value: object) -> StructuredOutput | None:
    if not isinstance(value, dict):
        raise _invalid("response_format must be an object", "response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _constraint(StructuredOutput, "json_object", "", "response_format")
    if kind != "json_schema":
        raise _invalid('response_format.type must be "text", "json_object" or "json_schema"',
                       "response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _invalid("response_format.json_schema must be an object",
                       "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
        raise _invalid("response_format.json_schema.name must be 1-64 letters, digits, _ or -",
                       "response_format.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _invalid("response_format.json_schema.strict must be a boolean",
                       "response_format.json_schema.strict")
    schema = spec.get("schema")
    if schema is None:  # no schema: any JSON object
        return _constraint(StructuredOutput, "json_object", "", "response_format.json_schema")
    constraint = _json_schema(schema, "response_format.json_schema.schema")
    if strict:
        _check_strict(json.loads(constraint.source), "response_format.json_schema.schema")
    return constraint


def _check_strict(schema: object, param: str) -> None:
    """`strict: true` as OpenAI's structured outputs define it: every object schema sets
    additionalProperties: false and requires every property it lists; else a 400 naming the
    object's path. (Keywords past OpenAI's subset are taken: the finished reply's check holds
    them.)"""
    stack: list[tuple[object, str]] = [(schema, "")]
    while stack:
        item, path = stack.pop()
        if not isinstance(item, dict):
            continue
        properties = item.get("properties")
        if item.get("type") == "object" or isinstance(properties, dict):
            if item.get("additionalProperties") is not False:
                raise _invalid(
                    "strict: true needs additionalProperties: false on every object schema "
                    "(send strict: false for this schema)", f"{param}{path}")
            listed = set(properties) if isinstance(properties, dict) else set()
            required = item.get("required", [])
            missing = sorted(listed - set(required if isinstance(required, list) else []))
            if missing:
                raise _invalid(
                    f"strict: true needs every property required; not required: "
                    f"{', '.join(missing)} (make them nullable, or send strict: false)",
                    f"{param}{path}.required")
        stack.extend((sub, f"{path}{where}") for where, sub in subschemas(item))


def _json_schema(schema: object, param: str) -> StructuredOutput:
    if isinstance(schema, str):  # vLLM takes the schema as JSON text too
        _constraint(StructuredOutput, "json_schema", schema, param)  # its size, before parsing
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise _invalid(f"the schema is not valid JSON: {exc}", param) from exc
        except RecursionError:
            raise _invalid("the schema is nested too deeply", param) from None
    # Lenient: what the grammar cannot enforce, the finished output's check does
    # (gateway.openai.schema_check).
    return _constraint(StructuredOutput.json_schema, schema, param, True)


def _text_source(kind: Any, value: object, param: str) -> StructuredOutput:
    if not isinstance(value, str) or not value:
        raise _invalid(f"{param} must be a non-empty string", param)
    return _constraint(StructuredOutput, kind, value, param)


def _structured_outputs(value: object) -> StructuredOutput:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise _invalid("structured_outputs must be an object", param)
    given = [key for key in _STRUCTURED_KEYS if value.get(key) not in (None, False)]
    unknown = sorted(set(value) - set(_STRUCTURED_KEYS) - {"disable_any_whitespace"})
    if unknown:
        raise _invalid(f"structured_outputs does not take {unknown[0]!r}",
                       f"{param}.{unknown[0]}")
    if len(given) != 1:
        raise _invalid("structured_outputs takes exactly one of: json, regex, choice, grammar, "
                       "json_object", param)
    key = given[0]
    field_param = f"{param}.{key}"
    if key == "json":
        return _json_schema(value[key], field_param)
    if key == "choice":
        return _constraint(StructuredOutput.choice, value[key], field_param)
    if key == "json_object":
        return _constraint(StructuredOutput, "json_object", "", field_param)
    return _text_source(_STRUCTURED_KEYS[key], value[key], field_param)


def tool_request(tools: object, tool_choice: object, parallel: object) -> ToolRequest:
    """tools, tool_choice and parallel_tool_calls of a chat request."""
    if parallel is not None and not isinstance(parallel, bool):
        raise _invalid("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    parsed, constraints = _tools(tools)
    choice = _tool_choice(tool_choice, parsed)
    return ToolRequest(parsed, choice, parallel is not False, constraints)


def _tools(value: object) -> tuple[tuple[FunctionTool, ...], tuple[StructuredOutput, ...]]:
    if value is None:
        return (), ()
    if not isinstance(value, list):
        raise _invalid("tools must be an array", "tools")
    if len(value) > MAX_TOOLS:
        raise _invalid(f"tools holds at most {MAX_TOOLS} tools", "tools")
    tools: list[FunctionTool] = []
    constraints: list[StructuredOutput] = []
    for index, item in enumerate(value):
        param = f"tools[{index}]"
        if not isinstance(item, dict) or item.get("type") != "function":
            raise _invalid('each tool must be an object with type "function"', f"{param}.type")
        function = item.get("function")
        if not isinstance(function, dict):
            raise _invalid("function must be an object", f"{param}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise _invalid("function.name must be 1-64 letters, digits, _ or -",
                           f"{param}.function.name")
        if any(tool.name == name for tool in tools):
            raise _invalid(f"two tools are named {name!r}", f"{param}.function.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _invalid("function.description must be a string",
                           f"{param}.function.description")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                raise _invalid("function.parameters must be a JSON schema object",
                               f"{param}.function.parameters")
            constraints.append(_constraint(StructuredOutput.json_schema, parameters,
                                           f"{param}.function.parameters"))
        tools.append(FunctionTool(name, description, parameters))
    return tuple(tools), tuple(constraints)


def _tool_choice(value: object, tools: tuple[FunctionTool, ...]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        if value == "required" and not tools:
            raise _invalid('tool_choice "required" needs tools', "tool_choice")
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise _invalid("tool_choice.function.name must be a string",
                           "tool_choice.function.name")
        if not any(tool.name == name for tool in tools):
            raise _invalid(f"tool_choice names {name!r}, which is not among the tools",
                           "tool_choice.function.name")
        return ToolChoice("function", name)
    raise _invalid('tool_choice must be "none", "auto", "required" or '
                   '{"type": "function", "function": {"name": ...}}', "tool_choice")
