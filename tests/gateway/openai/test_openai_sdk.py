"""A real `tiergate serve` process (demo model, SQLite) driven by the official openai SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve_process import ADMIN_TOKEN, ServeProcess

MODEL = "tiergate-demo"
MAX_BODY_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    db = tmp_path_factory.mktemp("sdk") / "tiergate.db"
    with ServeProcess(
        f"sqlite:///{db}", args=["--max-body-bytes", str(MAX_BODY_BYTES)]
    ).start() as process:
        yield process


@pytest.fixture(scope="module")
def api_key(server: ServeProcess) -> str:
    # An empty database: serve created the demo tenant and printed its key once.
    keys = server.printed_keys()
    assert len(keys) == 1, server.output()
    return keys[0]


@pytest.fixture(scope="module")
def client(server: ServeProcess, api_key: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=api_key, max_retries=0) as sdk:
        yield sdk


def _admin(server: ServeProcess) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"x-admin-token": ADMIN_TOKEN})


MESSAGES = [{"role": "user", "content": "Tell me about the weather today."}]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_stream_equals_non_stream_at_temperature_zero(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, logprobs=True
    )
    choice = full.choices[0]
    assert choice.message.role == "assistant"
    assert full.usage is not None and choice.logprobs is not None and choice.logprobs.content
    # usage counts exactly the tokens produced
    assert full.usage.completion_tokens == len(choice.logprobs.content)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True}, logprobs=True,
    )
    chunks = list(stream)
    ids = {c.id for c in chunks}
    created = {c.created for c in chunks}
    assert len(ids) == 1 and len(created) == 1
    content_chunks = [c for c in chunks if c.choices]
    assert content_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in content_chunks if c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    streamed_tokens = sum(
        len(c.choices[0].logprobs.content or []) for c in content_chunks if c.choices[0].logprobs
    )
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == streamed_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_stream_equals_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="Once upon a time", temperature=0,
                                     max_tokens=20)
    stream = list(client.completions.create(
        model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=20, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == full.choices[0].text
    assert stream[-1].usage is not None
    assert stream[-1].usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]


def test_n_choices_each_finish_once(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=3, max_tokens=12, stream=True, seed=7,
        stream_options={"include_usage": True},
    )
    finishes: dict[int, int] = {}
    roles: dict[int, int] = {}
    usage = None
    for c in stream:
        usage = c.usage or usage
        for choice in c.choices:
            roles[choice.index] = roles.get(choice.index, 0) + (choice.delta.role is not None)
            finishes[choice.index] = finishes.get(choice.index, 0) + bool(choice.finish_reason)
    assert finishes == {0: 1, 1: 1, 2: 1}
    assert roles == {0: 1, 1: 1, 2: 1}
    assert usage is not None and usage.completion_tokens == 36  # 3 x max_tokens, ignore none
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=8)
    assert sorted(c.index for c in full.choices) == [0, 1]


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    reference = client.completions.create(
        model=MODEL, prompt="The river", temperature=0, max_tokens=30
    ).choices[0].text
    assert len(reference) > 10
    stop = reference[5:8]
    cut = client.completions.create(
        model=MODEL, prompt="The river", temperature=0, max_tokens=30, stop=[stop]
    ).choices[0]
    assert cut.text == reference[: reference.index(stop)]
    assert cut.finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="The river", temperature=0, max_tokens=30, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.text


def test_seed_reproduces(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=16, seed=seed
        ).choices[0].message.content or ""

    assert sample(42) == sample(42)
    assert sample(42) != sample(43)


def test_token_id_prompts_and_max_completion_tokens(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.usage is not None and full.usage.prompt_tokens == 5
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=4, temperature=0
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    assert chat.choices[0].finish_reason == "length"


def test_errors_map_to_sdk_exceptions(server: ServeProcess, client: openai.OpenAI) -> None:
    base = f"{server.base_url}/v1"
    with (
        pytest.raises(openai.AuthenticationError),
        openai.OpenAI(base_url=base, api_key="tg-unknown0_nope", max_retries=0) as unknown,
    ):
        unknown.models.list()
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10**6)
    assert too_long.value.code == "context_length_exceeded"
    assert too_long.value.param == "max_tokens"
    with pytest.raises(openai.APIStatusError) as too_large:
        client.completions.create(model=MODEL, prompt="x " * MAX_BODY_BYTES, max_tokens=1)
    assert too_large.value.status_code == 413


def test_revoked_key_and_disabled_tenant_get_403(server: ServeProcess) -> None:
    with _admin(server) as admin:
        tenant = admin.post("/admin/v1/tenants", json={"name": "sdk-403", "tier": "standard"})
        assert tenant.status_code == 201, tenant.text
        tenant_id = tenant.json()["id"]
        created = admin.post(f"/admin/v1/tenants/{tenant_id}/keys", json={"name": "k"}).json()
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=created["key"],
                           max_retries=0) as key:
            assert key.models.list().data
            assert admin.post(f"/admin/v1/keys/{created['id']}/revoke").status_code == 200
            with pytest.raises(openai.PermissionDeniedError):
                key.models.list()
        other = admin.post(f"/admin/v1/tenants/{tenant_id}/keys", json={"name": "k2"}).json()
        assert admin.post(f"/admin/v1/tenants/{tenant_id}/disable").status_code == 200
        with (
            pytest.raises(openai.PermissionDeniedError),
            openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=other["key"],
                          max_retries=0) as disabled,
        ):
            disabled.models.list()


def test_bad_bodies_get_400_with_param(server: ServeProcess, api_key: str) -> None:
    headers = {"authorization": f"Bearer {api_key}"}
    cases = [
        (b"{not json", None),
        (b'{"model": "tiergate-demo", "messages": "hi"}', "messages"),
        (b'{"model": "tiergate-demo", "messages": [{"role": "robot", "content": "x"}]}',
         "messages[0].role"),
        (b'{"model": "tiergate-demo", "prompt": "x", "n": 0}', "n"),
        (b'{"model": "tiergate-demo", "prompt": "x", "frobnicate": 1}', "frobnicate"),
        (b'{"model": "tiergate-demo", "prompt": [1, 999999]}', "prompt"),
        (b'{"model": "tiergate-demo", "prompt": "x", "max_tokens": "7"}', "max_tokens"),
        (b'[1, 2]', None),
        # 30,000 nested arrays: too deep to parse, a 400 (was a 500 with a traceback)
        (b'{"model": "tiergate-demo", "prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",
         None),
        # lone surrogates: not text (they dropped the connection without a response)
        (b'{"model": "tiergate-demo", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
         "messages[0].content"),
        (b'{"model": "tiergate-demo", "prompt": ["ok", "x\\udfffy"]}', "prompt[1]"),
        (b'{"model": "tiergate-demo", "prompt": "x", "stop": ["\\ud834"]}', "stop[0]"),
        # stop strings are capped in length, not only in number
        (b'{"model": "tiergate-demo", "prompt": "x", "stop": ["a", "' + b"s" * 1025 + b'"]}',
         "stop[1]"),
        (b'{"model": "tiergate-demo", "prompt": "x", "stop": "' + b"s" * 50_000 + b'"}', "stop"),
    ]
    for body, param in cases:
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        response = httpx.post(f"{server.base_url}{path}", content=body, headers=headers)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, body


def test_request_id_and_processing_time_headers(server: ServeProcess, api_key: str) -> None:
    response = httpx.get(
        f"{server.base_url}/v1/models",
        headers={"authorization": f"Bearer {api_key}", "x-request-id": "trace-123"},
    )
    assert response.headers["x-request-id"] == "trace-123"
    assert int(response.headers["openai-processing-ms"]) >= 0
    generated = httpx.get(f"{server.base_url}/health/live").headers["x-request-id"]
    assert generated.startswith("req_")


def test_readme_curl_line_is_printed(server: ServeProcess, api_key: str) -> None:
    output = server.output()
    assert f"Authorization: Bearer {api_key}" in output
    assert f"{server.base_url}/v1/chat/completions" in output
    assert Path(server.log_path).exists()


def test_odd_unicode_names_are_answered_never_crashed(server: ServeProcess, api_key: str) -> None:
    """Names in odd Unicode (control characters, a right-to-left override, zero-width
    characters, emoji, very long) in the places a request may carry one: each gets an
    answer (served, or a 4xx in the OpenAI shape), never a 500 or a dropped connection."""
    headers = {"authorization": f"Bearer {api_key}"}
    odd = ["\u202eevil\u0000", "\u200b\u200d\ufeff", "😀" * 2000, "a\u0301\u0301\u0301",
           "\U0010ffff", "\x7f\x1b[31m"]
    tool = {"type": "function", "function": {"name": "", "parameters": {"type": "object"}}}
    bodies: list[tuple[str, dict[str, object]]] = []
    for name in odd:
        chat = {"model": "tiergate-demo", "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi", "name": name}]}
        bodies.append(("/v1/chat/completions", chat))
        bodies.append(("/v1/chat/completions", {
            **chat, "tools": [{**tool, "function": {**tool["function"], "name": name}}],
        }))
        bodies.append(("/v1/completions", {"model": name, "prompt": "x", "max_tokens": 1}))
        bodies.append(("/v1/completions", {"model": "tiergate-demo", "prompt": "x",
                                           "max_tokens": 1, "user": name}))
    statuses = []
    for path, body in bodies:
        response = httpx.post(f"{server.base_url}{path}", json=body, headers=headers)
        statuses.append(response.status_code)
        assert response.status_code in (200, 400, 404), (body, response.text[:300])
        if response.status_code != 200:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    print(f"\n{len(bodies)} requests with odd Unicode names: "
          f"{', '.join(f'{statuses.count(c)} x {c}' for c in sorted(set(statuses)))}")
