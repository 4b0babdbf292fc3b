"""OpenAI's `service_tier` end to end with the official SDK: each value, a tier above the
tenant's plan (downgraded, or refused by the setting), the tier in the response and its
stream, and the price in the usage record (the served tier's)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import select

from billing import Pricing
from billing.models import USAGE_RECORDS
from gateway.server.model_source import DEMO_MODEL_NAME
from tests.gateway.app_harness import InProcessGateway, start_gateway

MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessGateway]:
    with start_gateway(tmp_path_factory.mktemp("service-tier")) as running:
        yield running


def _record(gateway: InProcessGateway, request_id: str) -> Any:
    with gateway.runtime.session_factory() as session:
        return session.execute(
            select(USAGE_RECORDS).where(USAGE_RECORDS.c.request_id == request_id)).one()


def _chat(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(model=DEMO_MODEL_NAME, messages=MESSAGES,
                                          max_tokens=4, **extra)


def test_each_service_tier_is_served_reported_and_priced(gateway: InProcessGateway) -> None:
    _, key = gateway.create_tenant("standard-co", "standard")
    client = gateway.openai_client(key)
    served = {}
    for asked in (None, "auto", "default", "flex", "priority", "fast"):
        reply = _chat(client) if asked is None else _chat(client, service_tier=asked)
        record = _record(gateway, reply.id)
        served[asked] = (reply.service_tier, record.tier)
        # Priced at the served tier's prices.
        assert record.amount_usd_micros == Pricing().charge_usd_micros(
            record.tier, num_prompt_tokens=record.num_prompt_tokens,
            num_cached_prompt_tokens=record.num_cached_prompt_tokens,
            num_completion_tokens=record.num_completion_tokens,
            gpu_seconds=record.gpu_seconds) > 0
    # A standard tenant may go down to flex (batch); priority is above its plan: downgraded.
    assert served == {
        None: ("default", "standard"), "auto": ("default", "standard"),
        "default": ("default", "standard"), "flex": ("flex", "batch"),
        "priority": ("default", "standard"), "fast": ("default", "standard"),
    }
    flex = _record(gateway, _chat(client, service_tier="flex").id)
    standard = _record(gateway, _chat(client).id)
    per_token = {r.tier: r.amount_usd_micros / (r.num_prompt_tokens + r.num_completion_tokens)
                 for r in (flex, standard)}
    assert per_token["batch"] < per_token["standard"]  # half price, by default

    _, premium_key = gateway.create_tenant("premium-co", "premium")
    premium = gateway.openai_client(premium_key)
    assert _chat(premium, service_tier="fast").service_tier == "priority"
    assert _chat(premium).service_tier == "priority"
    assert _chat(premium, service_tier="default").service_tier == "default"

    # Streams carry it in every chunk.
    chunks = list(client.chat.completions.create(
        model=DEMO_MODEL_NAME, messages=MESSAGES, max_tokens=3, stream=True,
        service_tier="flex", stream_options={"include_usage": True}))
    assert chunks and {chunk.service_tier for chunk in chunks} == {"flex"}
    completion = client.completions.create(model=DEMO_MODEL_NAME, prompt="Hi", max_tokens=2,
                                           extra_body={"service_tier": "flex"})
    assert completion.model_extra is not None
    assert completion.model_extra["service_tier"] == "flex"
    assert _record(gateway, completion.id).tier == "batch"


def test_values_no_tier_serves_are_refused(gateway: InProcessGateway) -> None:
    _, key = gateway.create_tenant("picky-co", "standard")
    client = gateway.openai_client(key)
    for value, message in (("scale", "service_tier 'scale' is not offered by this server"),
                           ("turbo", "service_tier must be one of auto")):
        with pytest.raises(openai.BadRequestError) as refused:
            _chat(client, service_tier=value)
        assert message in refused.value.message
        assert refused.value.body is not None
        assert refused.value.body["param"] == "service_tier"  # type: ignore[index]


def test_above_the_plan_is_refused_when_the_setting_says_so(tmp_path: Path) -> None:
    with start_gateway(tmp_path, service_tier_above_plan="refuse") as gateway:
        _, key = gateway.create_tenant("standard-co", "standard")
        client = gateway.openai_client(key)
        with pytest.raises(openai.PermissionDeniedError) as refused:
            _chat(client, service_tier="priority")
        assert "above your plan (standard, service_tier 'default')" in refused.value.message
        assert refused.value.code == "service_tier_not_allowed"
        assert _chat(client, service_tier="flex").service_tier == "flex"
