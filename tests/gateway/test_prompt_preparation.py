"""Where the gateway tokenizes a prompt: on the event loop, with no hand-over to a worker
thread (the tokenizer holds the GIL while it encodes, so a thread never freed the loop; it
only delayed the request). Both endpoints, and a prompt refused while it is prepared.

The replica runs in this process (tests/gateway/app_harness.py); clients use the openai SDK.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

import gateway.openai_routes as openai_routes
from gateway.model_source import DEMO_MODEL_NAME
from tests.gateway.app_harness import start_gateway


def test_prompts_are_tokenized_on_the_event_loop(
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
    finally:
        gateway.stop()
    assert on_loop == [True, True, True]
    assert completion.usage is not None and completion.usage.prompt_tokens > 0
    assert completion.usage.completion_tokens == 4
    assert chat.usage is not None and chat.usage.prompt_tokens > 0
