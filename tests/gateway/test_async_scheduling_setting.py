"""`--async-scheduling` / TIERGATE_ASYNC_SCHEDULING: read, checked, handed to the engine, and
the same answers through a replica with it on and off."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import build_parser
from gateway.server.model_source import DEMO_MODEL_NAME
from gateway.server.served_model import build_engine
from gateway.server.settings import GatewaySettings, SettingsError
from policies import TierTable
from tests.gateway.app_harness import start_gateway
from tests.serve_process import shared_demo_model_dir

NO_SHEDDING = {"admission": {"enable_shedding": False}}  # a cold replica admits everything


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
    engine = build_engine(settings, TierTable(), shared_demo_model_dir())
    assert engine.async_scheduling is expected


def test_the_flag_wins_over_the_environment() -> None:
    args = build_parser().parse_args(["serve", "--async-scheduling", "on"])
    settings = GatewaySettings.from_sources(args, environ={"TIERGATE_ASYNC_SCHEDULING": "off"})
    assert settings.async_scheduling == "on"


def _served_outputs(work_dir: Path, async_scheduling: str) -> list[object]:
    """What the official client gets from a replica (the fake runner's tokens are a function
    of the context): a stream cut by a stop string, two samples, a length-limited completion,
    with their usage."""
    work_dir.mkdir()
    gateway = start_gateway(work_dir, file_config=NO_SHEDDING, async_scheduling=async_scheduling)
    try:
        _, key = gateway.create_tenant("acme", "standard")
        client = gateway.openai_client(key)
        messages = [{"role": "user", "content": "Tell me a story about the sea."}]
        full = client.chat.completions.create(model=DEMO_MODEL_NAME, messages=messages,
                                              max_tokens=24, temperature=0.0)
        text = full.choices[0].message.content or ""
        stop = text[8:12]
        chunks = list(client.chat.completions.create(
            model=DEMO_MODEL_NAME, messages=messages, max_tokens=24, temperature=0.0,
            stop=[stop], stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
        assert usage is not None
        samples = client.completions.create(model=DEMO_MODEL_NAME, prompt="Once upon a time",
                                            max_tokens=10, n=2, temperature=1.0, seed=3)
        return [text, full.usage.completion_tokens if full.usage else None, stop in text,
                streamed, finish, usage.completion_tokens,
                [(c.text, c.finish_reason) for c in samples.choices],
                samples.usage.completion_tokens if samples.usage else None]
    finally:
        gateway.stop()


def test_a_replica_answers_the_same_with_async_scheduling(tmp_path: Path) -> None:
    """Through the HTTP API and the official client: the same texts, finish reasons and token
    counts with async scheduling on as off."""
    sync = _served_outputs(tmp_path / "sync", "off")
    ahead = _served_outputs(tmp_path / "async", "on")
    assert ahead == sync
    assert sync[2] is True and sync[4] == "stop"  # the stop string cut the stream
    assert len(sync[3]) < len(sync[0])  # type: ignore[arg-type]
