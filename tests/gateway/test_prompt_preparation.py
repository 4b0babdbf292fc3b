"""Where the gateway tokenizes a prompt: on the event loop for a body up to
`_INLINE_PREPARE_MAX_BYTES` (the tokenizer holds the GIL anyway, and a worker thread only adds
two hand-overs before admission), in a worker thread above it. Either way the request is
served the same.

The replica runs in this process (tests/gateway/app_harness.py); clients use the openai SDK.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

import gateway.openai_routes as openai_routes
from gateway.served_model import DEMO_MODEL_NAME
from tests.gateway.app_harness import start_gateway

PROMPT = "The gateway prepares this prompt"


def test_small_bodies_are_tokenized_on_the_event_loop_large_ones_off_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_loop: list[bool] = []
    prepare = openai_routes.prepare_prompts

    def recording_prepare(*args: Any) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no loop runs in a worker thread
            on_loop.append(False)
        return prepare(*args)

    monkeypatch.setattr(openai_routes, "prepare_prompts", recording_prepare)
    gateway = start_gateway(tmp_path)
    try:
        _, key = gateway.create_tenant("preparer", "standard")
        client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=key, max_retries=0)

        def complete() -> openai.types.Completion:
            return client.completions.create(
                model=DEMO_MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0
            )

        small = complete()
        monkeypatch.setattr(openai_routes, "_INLINE_PREPARE_MAX_BYTES", 16)
        large = complete()  # the same body, now over the (lowered) bound
        with pytest.raises(openai.BadRequestError, match="outside this model's vocabulary"):
            client.completions.create(model=DEMO_MODEL_NAME, prompt=[10**9], max_tokens=1)
    finally:
        gateway.stop()
    assert on_loop == [True, False, False]
    assert small.choices[0].text == large.choices[0].text
    assert small.usage is not None and large.usage is not None
    assert small.usage.prompt_tokens == large.usage.prompt_tokens > 0
