"""`--async-scheduling` / TIERGATE_ASYNC_SCHEDULING: read, checked, handed to the engine, and
the same answers from `tiergate serve` with it on and off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.cli import build_parser
from gateway.server.model_source import DEMO_MODEL_NAME
from gateway.server.model_spec import ModelSpec
from gateway.server.served_model import build_engine
from gateway.server.settings import GatewaySettings, SettingsError
from policies import TierTable
from tests.serve_process import ServeProcess, shared_demo_model_dir


def test_a_value_other_than_auto_on_off_is_refused() -> None:
    with pytest.raises(SettingsError, match="--async-scheduling must be auto, on or off"):
        GatewaySettings.from_sources(environ={"TIERGATE_ASYNC_SCHEDULING": "yes"})


@pytest.mark.parametrize(("environ", "expected"), [({}, False),
                                                   ({"TIERGATE_ASYNC_SCHEDULING": "on"}, True),
                                                   ({"TIERGATE_ASYNC_SCHEDULING": "off"}, False)])
def test_the_setting_reaches_the_engine(environ: dict[str, str], expected: bool) -> None:
    """auto: the runner decides (on the CPU its steps are done when execute returns: off)."""
    settings = GatewaySettings.from_sources(environ={**environ,
                                                     "TIERGATE_KV_CACHE_BYTES": str(16 << 20)})
    engine = build_engine(settings, TierTable(), ModelSpec(), shared_demo_model_dir())
    assert engine.async_scheduling is expected


def test_the_flag_wins_over_the_environment() -> None:
    args = build_parser().parse_args(["serve", "--async-scheduling", "on"])
    settings = GatewaySettings.from_sources(args, environ={"TIERGATE_ASYNC_SCHEDULING": "off"})
    assert settings.async_scheduling == "on"


def _served_outputs(database_path: Path, async_scheduling: str) -> list[object]:
    """What the official client gets from `tiergate serve` on the demo model: a greedy chat
    with logprobs, the same streamed and cut by a stop string, two seeded samples, with their
    usage."""
    with ServeProcess(f"sqlite:///{database_path}",
                      args=["--async-scheduling", async_scheduling,
                            "--log-level", "info"]).start() as server:
        assert f"async scheduling {async_scheduling}" in server.output()
        (key,) = server.printed_keys()  # an empty database: serve made the demo tenant's key
        with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key,
                           max_retries=0) as client:
            messages: list[Any] = [{"role": "user", "content": "Tell me a story about the sea."}]
            full = client.chat.completions.create(model=DEMO_MODEL_NAME, messages=messages,
                                                  max_tokens=24, temperature=0.0,
                                                  logprobs=True, top_logprobs=2)
            choice = full.choices[0]
            text = choice.message.content or ""
            assert choice.logprobs is not None and choice.logprobs.content is not None
            logprobs = [(t.token, round(t.logprob, 4)) for t in choice.logprobs.content]
            stop = text[8:12]
            chunks = list(client.chat.completions.create(
                model=DEMO_MODEL_NAME, messages=messages, max_tokens=24, temperature=0.0,
                stop=[stop], stream=True, stream_options={"include_usage": True}))
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
            assert usage is not None and full.usage is not None
            samples = client.completions.create(model=DEMO_MODEL_NAME,
                                                prompt="Once upon a time", max_tokens=10, n=2,
                                                temperature=1.0, seed=3)
            assert samples.usage is not None
            return [text, logprobs, full.usage.completion_tokens, stop in text, streamed,
                    finish, usage.completion_tokens,
                    [(c.text, c.finish_reason) for c in samples.choices],
                    samples.usage.completion_tokens]


def test_a_server_answers_the_same_with_async_scheduling(tmp_path: Path) -> None:
    """`tiergate serve` on the demo model (its own engine process), through the HTTP API and
    the official client: the same texts, logprobs, finish reasons and token counts with async
    scheduling on as off."""
    sync = _served_outputs(tmp_path / "sync.db", "off")
    ahead = _served_outputs(tmp_path / "async.db", "on")
    assert ahead == sync
    assert sync[3] is True and sync[5] == "stop"  # the stop string cut the stream
    assert len(sync[4]) < len(sync[0])  # type: ignore[arg-type]
