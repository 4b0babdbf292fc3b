"""Valid but costly requests, and numbers at the edge of JSON, against a replica: each is a
clear 4xx, costs its own tenant, and leaves the others alone.

The replica runs in this process (tests/gateway/app_harness.py) over SQLite, clients over HTTP.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server.model_source import DEMO_MODEL_NAME
from policies import DEFAULT_TIERS, TierTable
from tests.gateway.app_harness import InProcessGateway, start_gateway

CHAT: dict[str, Any] = {"model": DEMO_MODEL_NAME, "max_tokens": 2,
                        "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[InProcessGateway]:
    # The batch tier may not send raw grammars; the others may.
    tiers = TierTable(tuple(replace(t, raw_grammars=t.name != "batch") for t in DEFAULT_TIERS))
    with start_gateway(tmp_path, tiers=tiers) as running:
        yield running


def _post(gateway: InProcessGateway, key: str, body: bytes | dict[str, Any]) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(base_url=gateway.base_url, timeout=60) as client:
        return client.post("/v1/chat/completions", content=content,
                           headers={"authorization": f"Bearer {key}",
                                    "content-type": "application/json"})


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'"temperature": 1' + b"0" * 400, "temperature"),  # a 401-digit integer: a 500 before
        (b'"top_p": -1' + b"0" * 400, "top_p"),
        (b'"temperature": 1e400', "temperature"),
        (b'"response_format": {"type": "json_schema", "json_schema": {"name": "n", '
         b'"schema": {"type": "number", "minimum": 1e400}}}',
         "response_format.json_schema.schema.minimum"),
        (b'"tool_choice": "required", "tools": [{"type": "function", "function": {"name": '
         b'"f", "parameters": {"type": "object", "properties": {"x": {"type": "number", '
         b'"maximum": 1e400}}}}}]', "tools[0].function.parameters.properties.x.maximum"),
        (b'"response_format": {"type": "json_schema", "json_schema": {"name": "n", '
         b'"schema": {"type": "integer", "maximum": 1' + b"0" * 400 + b"}}}",
         "response_format.json_schema.schema.maximum"),
        (b'"stop_token_ids": [' + b",".join(b"7" for _ in range(1025)) + b"]",
         "stop_token_ids"),
        (b'"seed": 1' + b"0" * 400, "seed"),
    ],
)
def test_numbers_at_the_edge_are_400s_naming_their_field(
    gateway: InProcessGateway, raw: bytes, param: str
) -> None:
    _, key = gateway.create_tenant("edge", "standard")
    body = (b'{"model": "' + DEMO_MODEL_NAME.encode() + b'", "max_tokens": 2, '
            b'"messages": [{"role": "user", "content": "hi"}], ' + raw + b"}")
    response = _post(gateway, key, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


def test_a_tier_without_raw_grammars_gets_a_400_others_pass(gateway: InProcessGateway) -> None:
    _, batch = gateway.create_tenant("bulk", "batch")
    _, standard = gateway.create_tenant("app", "standard")
    grammar = {**CHAT, "guided_grammar": 'start: "yes" | "no"\n'}
    refused = _post(gateway, batch, grammar)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "unsupported_parameter"
    assert refused.json()["error"]["param"] == "guided_grammar"
    assert _post(gateway, standard, grammar).status_code == 200
    # A JSON schema is not a raw grammar: the batch tier may send one.
    schema = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object"}}}}
    assert _post(gateway, batch, schema).status_code == 200


def test_a_spent_tenant_is_refused_before_its_body_is_read(gateway: InProcessGateway) -> None:
    """One request a minute: the second, not even JSON, is a 429 (refused before it is
    read and parsed), where it was a 400 when its body was parsed first."""
    _, key = gateway.create_tenant("spent", "standard", {"requests_per_minute": 1})
    assert _post(gateway, key, CHAT).status_code == 200
    second = _post(gateway, key, b"{not json")
    assert second.status_code == 429, second.text
    assert second.json()["error"]["code"] == "rate_limit_exceeded"


def test_large_bodies_spend_their_tenants_share_of_the_loop_only(
    gateway: InProcessGateway,
) -> None:
    """Bodies of 400,000 stop token ids (2.8 MB, each refused with a 400 once parsed) from
    a tenant with no limits: after its share of the loop's parse time is spent the rest
    are refused before they are read (429, connection closed); another tenant's large body
    is still read."""
    rng = random.Random(0)
    heavy_body = json.dumps({**CHAT, "stop_token_ids": [
        rng.randrange(4096) for _ in range(400_000)]}).encode()
    _, heavy = gateway.create_tenant("heavy", "standard")
    _, other = gateway.create_tenant("other", "standard")
    statuses: list[int] = []
    refusal: httpx.Response | None = None
    for _ in range(80):
        response = _post(gateway, heavy, heavy_body)
        statuses.append(response.status_code)
        if response.status_code == 429:
            refusal = response
            break
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "stop_token_ids"
    assert refusal is not None, f"never refused: {statuses}"
    assert refusal.headers["connection"] == "close"
    assert "share of this server's time" in refusal.json()["error"]["message"]
    assert float(refusal.headers["retry-after-ms"]) > 0
    assert _post(gateway, other, heavy_body).status_code == 400  # read, parsed, refused
