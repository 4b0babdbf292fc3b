"""What a prompt costs the gateway before admission, and who pays for it.

- Small bodies are tokenized on the event loop (a hand-over to a thread only delays them);
  a body over LARGE_BODY_BYTES in a worker thread whose encoder releases the GIL, so other
  tenants are served while it encodes.
- A text that cannot fit the context is refused from its size, never encoded.
- A request refused with a 4xx costs its tenant a request and the tokens found; a tenant
  whose rate limits are spent is refused a large body before it is read.
- The operator's bounds (messages, prompts x n) refuse before any of that.

The replica runs in this process (tests/gateway/app_harness.py); clients use the openai SDK.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import gateway.openai.generation as generation
from engine.text.tokenizer import Tokenizer
from gateway.access.refusal_hold import SCREEN_HOLD_MAX_S
from gateway.openai.body import LARGE_BODY_BYTES
from gateway.server.model_source import DEMO_MODEL_NAME
from tests.gateway.app_harness import InProcessGateway, start_gateway


class _PrepareSpy:
    """Wraps gateway.openai.generation._prepare: where each call ran, and events around the first.
    With hold, the first call waits for it before it prepares (as a long encode would)."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, hold: threading.Event | None = None
    ) -> None:
        self.on_loop: list[bool] = []
        self.started = threading.Event()
        self.finished = threading.Event()
        prepare = generation._prepare

        def spy(*args: Any) -> Any:
            try:
                asyncio.get_running_loop()
                self.on_loop.append(True)
            except RuntimeError:  # no loop runs in a worker thread
                self.on_loop.append(False)
            first = not self.started.is_set()
            self.started.set()
            try:
                if hold is not None and first:
                    hold.wait(60)
                return prepare(*args)
            finally:
                if first:
                    self.finished.set()

        monkeypatch.setattr(generation, "_prepare", spy)


class _EncodeCounter:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.num_calls = 0
        for name in ("encode", "encode_unlocked"):
            original = getattr(Tokenizer, name)

            def counted(tokenizer: Tokenizer, *args: Any, _original: Any = original) -> Any:
                self.num_calls += 1
                return _original(tokenizer, *args)

            monkeypatch.setattr(Tokenizer, name, counted)


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[InProcessGateway]:
    with start_gateway(tmp_path, max_messages=4, max_choices=16) as running:
        yield running


def _client(gateway: InProcessGateway, key: str) -> openai.OpenAI:
    return gateway.openai_client(key)


def test_small_prompts_are_tokenized_on_the_event_loop(
    gateway: InProcessGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _PrepareSpy(monkeypatch)
    _, key = gateway.create_tenant("preparer", "standard")
    client = _client(gateway, key)
    completion = client.completions.create(
        model=DEMO_MODEL_NAME, prompt="The gateway prepares this prompt", max_tokens=4
    )
    chat = client.chat.completions.create(
        model=DEMO_MODEL_NAME,
        messages=[{"role": "user", "content": "The gateway renders this conversation"}],
        max_tokens=4,
    )
    with pytest.raises(openai.BadRequestError, match="outside this model's vocabulary"):
        client.completions.create(model=DEMO_MODEL_NAME, prompt=[10**9], max_tokens=1)
    assert spy.on_loop == [True, True, True]
    assert completion.usage is not None and completion.usage.prompt_tokens > 0
    assert completion.usage.completion_tokens == 4
    assert chat.usage is not None and chat.usage.prompt_tokens > 0


def test_a_large_body_is_tokenized_in_a_thread_while_other_tenants_are_served(
    gateway: InProcessGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The heavy request's preparation is held until the light request is answered: were it
    # on the event loop, the light request could not be answered (and would time out).
    hold = threading.Event()
    spy = _PrepareSpy(monkeypatch, hold)
    quota = {"tokens_per_minute": 60_000, "requests_per_minute": 1000}
    _, heavy_key = gateway.create_tenant("heavy", "standard", quota)
    _, light_key = gateway.create_tenant("light", "standard")
    # 8 prompts, each just under the size a prompt can have and still fit the context (so
    # each is encoded), of random letters (few letters a token: the slowest text to encode).
    served, _ = gateway.runtime.host().ready()
    assert served.tokenizer.max_token_bytes is not None
    size = served.tokenizer.max_token_bytes * (served.max_model_len - 1) - 1
    rng = random.Random(0)
    prompts = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(size))
               for _ in range(8)]
    heavy_result: list[object] = []

    def send_heavy() -> None:
        try:
            _client(gateway, heavy_key).completions.create(
                model=DEMO_MODEL_NAME, prompt=prompts, max_tokens=1
            )
        except openai.APIError as exc:
            heavy_result.append(exc)

    heavy = threading.Thread(target=send_heavy)
    heavy.start()
    try:
        assert spy.started.wait(30), heavy_result
        light = gateway.openai_client(light_key, timeout=20).chat.completions.create(
            model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        served_meanwhile = not spy.finished.is_set()
    finally:
        hold.set()
        heavy.join(60)
    assert light.usage is not None and light.usage.completion_tokens == 2
    assert served_meanwhile
    assert spy.on_loop[0] is False  # the heavy body, in a worker thread
    # Each prompt, encoded, is longer than the context: 400, and the tokens it was found to
    # hold are charged (far more than the bucket's 60,000: it is emptied, and refills at
    # 1,000 a second), as the tenant's next request shows.
    (error,) = heavy_result
    assert isinstance(error, openai.BadRequestError)
    assert error.code == "context_length_exceeded"
    after = _client(gateway, heavy_key).completions.with_raw_response.create(
        model=DEMO_MODEL_NAME, prompt="small", max_tokens=1
    )
    assert int(after.headers["x-ratelimit-remaining-tokens"]) < 30_000


def test_a_spent_tenant_is_refused_a_large_body_before_it_is_read(
    gateway: InProcessGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _PrepareSpy(monkeypatch)
    encodes = _EncodeCounter(monkeypatch)
    _, key = gateway.create_tenant("one-rpm", "standard", {"requests_per_minute": 1})
    huge = "a" * (3 << 20)  # 3 MiB: under the body limit, far over the context
    messages = [{"role": "user", "content": huge}]
    client = _client(gateway, key)
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=DEMO_MODEL_NAME, messages=messages, max_tokens=1)
    assert too_long.value.code == "context_length_exceeded"
    assert "at least" in too_long.value.message
    assert encodes.num_calls == 0  # refused from its size
    # The refusal cost the one request a minute: the next large body is refused before it is
    # read (chunked, no content-length: found while reading) and prepared, and answered once
    # its retry delay (a minute) or SCREEN_HOLD_MAX_S has passed, so a client sending such
    # bodies back to back gets about one refusal a second.
    for chunked in (False, True):
        content: Any = _chunks(huge, messages) if chunked else None
        started = time.monotonic()
        response = httpx.post(
            f"{gateway.base_url}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
            json=None if chunked else {"model": DEMO_MODEL_NAME, "messages": messages},
            content=content,
            timeout=30,
        )
        assert response.status_code == 429, response.text
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        assert "RPM" in response.json()["error"]["message"]
        assert int(response.headers["retry-after"]) > 0
        assert time.monotonic() - started >= SCREEN_HOLD_MAX_S
    assert len(spy.on_loop) == 1 and encodes.num_calls == 0


def _chunks(huge: str, messages: list[dict[str, str]]) -> Iterator[bytes]:
    import json

    body = json.dumps({"model": DEMO_MODEL_NAME, "messages": messages}).encode()
    for start in range(0, len(body), LARGE_BODY_BYTES // 2):
        yield body[start:start + LARGE_BODY_BYTES // 2]


def test_bad_requests_count_against_the_request_limit(gateway: InProcessGateway) -> None:
    _, key = gateway.create_tenant("sloppy", "standard", {"requests_per_minute": 2})
    client = _client(gateway, key)
    for _ in range(2):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=DEMO_MODEL_NAME, prompt="x", temperature=-1)
    with pytest.raises(openai.RateLimitError, match="RPM"):
        client.completions.create(model=DEMO_MODEL_NAME, prompt="x", max_tokens=1)


def test_the_operators_bounds_refuse_fan_out_and_long_conversations(
    gateway: InProcessGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _PrepareSpy(monkeypatch)
    _, key = gateway.create_tenant("fan-out", "standard")
    client = _client(gateway, key)
    with pytest.raises(openai.BadRequestError, match="at most 16") as fan_out:
        client.completions.create(model=DEMO_MODEL_NAME, prompt=["a", "b", "c"], n=6)
    assert fan_out.value.param == "prompt"
    with pytest.raises(openai.BadRequestError, match="at most 16") as many_prompts:
        client.completions.create(model=DEMO_MODEL_NAME, prompt=["a"] * 17)
    assert many_prompts.value.param == "prompt"
    with pytest.raises(openai.BadRequestError, match="at most 16") as wide:
        client.chat.completions.create(
            model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "a"}], n=17
        )
    assert wide.value.param == "n"
    with pytest.raises(openai.BadRequestError, match="at most 4") as long_chat:
        client.chat.completions.create(
            model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "a"}] * 5
        )
    assert long_chat.value.param == "messages"
    assert spy.on_loop == []  # none of them reached tokenization
    within = client.completions.create(
        model=DEMO_MODEL_NAME, prompt=["a", "b", "c", "d"], n=4, max_tokens=1
    )
    assert len(within.choices) == 16
