"""Several base models behind one gateway: the default model and the demo model served by one
`tiergate serve`, each in an engine process of its own; requests routed by `model`; each
tenant's allowed models (admin API, CLI); usage records and metrics labelled by model; a
model that fails to load while the other serves."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.server.model_source import DEFAULT_MODEL_NAME, DEMO_MODEL_NAME
from tests.gateway.serve_harness import admin_client, billing_periods, detail_export
from tests.serve_process import ServeProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    work = tmp_path_factory.mktemp("two-models")
    server = ServeProcess(
        f"sqlite:///{work / 'db'}",
        env={"TIERGATE_MODEL_CACHE_DIR": str(work / "cache")},
        args=["--model", "default", "--model", "demo", "--kv-cache-bytes", str(64 << 20),
              "--max-model-len", "1024"],
    )
    with server.start(timeout_s=300):
        yield server


def _tenant(server: ServeProcess, name: str, allowed: list[str] | None) -> str:
    with admin_client(server) as admin:
        created = admin.post("/admin/v1/tenants",
                             json={"name": name, "tier": "standard", "allowed_models": allowed})
        assert created.status_code == 201, created.text
        assert created.json()["allowed_models"] == allowed
        key = admin.post(f"/admin/v1/tenants/{name}/keys", json={"name": "k"})
        assert key.status_code == 201, key.text
        return str(key.json()["key"])


def _client(server: ServeProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def _hi(client: openai.OpenAI, model: str) -> Any:
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def _engine_up(server: ServeProcess) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return {sample.labels["model"]: sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == "tiergate_engine_up"}


def test_requests_route_by_model_to_their_own_engines(two_models: ServeProcess) -> None:
    since = datetime.now(UTC)
    key = _tenant(two_models, "both", None)
    ready = httpx.get(f"{two_models.base_url}/health/ready", timeout=30).json()
    assert ready["models"] == {DEFAULT_MODEL_NAME: "up", DEMO_MODEL_NAME: "up"}
    with _client(two_models, key) as client:
        assert sorted(m.id for m in client.models.list()) == sorted(
            [DEFAULT_MODEL_NAME, DEMO_MODEL_NAME])
        answers = {}
        for model in (DEFAULT_MODEL_NAME, DEMO_MODEL_NAME):
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "What is 2 + 2?"}],
                max_tokens=8, temperature=0)
            assert reply.model == model
            assert reply.usage is not None and reply.usage.completion_tokens > 0
            answers[model] = reply.choices[0].message.content
        # The real model answers in words; the demo model's random weights do not agree.
        assert answers[DEFAULT_MODEL_NAME] != answers[DEMO_MODEL_NAME]
    # Each engine is a process of its own with its own KV pool.
    live = httpx.get(f"{two_models.base_url}/admin/v1/live",
                     headers={"x-admin-token": "test-admin-token-0123456789"}, timeout=30)
    assert [row["model"] for row in live.json()["models"]] == [DEFAULT_MODEL_NAME,
                                                               DEMO_MODEL_NAME]
    assert all(row["kv_blocks_total"] > 0 for row in live.json()["models"])
    assert _engine_up(two_models) == {DEFAULT_MODEL_NAME: 1.0, DEMO_MODEL_NAME: 1.0}
    # Usage records and metrics name the model.
    records = [r for r in detail_export(two_models, billing_periods(since))
               if r["status"] == "completed"]
    assert sorted(r["model"] for r in records) == sorted([DEFAULT_MODEL_NAME, DEMO_MODEL_NAME])
    text = httpx.get(f"{two_models.base_url}/metrics", timeout=30).text
    completion = {sample.labels["model"]: sample.value
                  for family in text_string_to_metric_families(text)
                  for sample in family.samples
                  if sample.name == "tiergate_tokens_total"
                  and sample.labels["kind"] == "completion"}
    assert completion[DEFAULT_MODEL_NAME] > 0 and completion[DEMO_MODEL_NAME] > 0


def test_a_tenant_sees_and_reaches_only_its_allowed_models(two_models: ServeProcess) -> None:
    key = _tenant(two_models, "demo-only", [DEMO_MODEL_NAME])
    with _client(two_models, key) as client:
        assert [m.id for m in client.models.list()] == [DEMO_MODEL_NAME]
        with pytest.raises(openai.NotFoundError) as denied:
            client.chat.completions.create(
                model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                max_tokens=2)
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}],
                max_tokens=2)
        # The same answer as for a model that does not exist, but for its name.
        assert denied.value.body == json.loads(json.dumps(missing.value.body).replace(
            "no-such-model", DEFAULT_MODEL_NAME))
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(DEFAULT_MODEL_NAME)
        assert client.chat.completions.create(
            model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
            max_tokens=2).model == DEMO_MODEL_NAME
    # The CLI changes the list in the database (as the admin API does).
    database = two_models.database_url
    subprocess.run(
        [sys.executable, "-m", "gateway.cli", "tenants", "update", "demo-only",
         "--allowed-models", f"{DEMO_MODEL_NAME},{DEFAULT_MODEL_NAME}",
         "--database-url", database, "--json"],
        check=True, capture_output=True, text=True, timeout=60)
    with admin_client(two_models) as admin:
        shown = admin.get("/admin/v1/tenants/demo-only").json()
        assert shown["allowed_models"] == [DEMO_MODEL_NAME, DEFAULT_MODEL_NAME]
        # Bad lists are refused with the field named, and change nothing.
        bad = admin.patch("/admin/v1/tenants/demo-only",
                          json={"allowed_models": ["has space"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_models[0]"
        narrowed = admin.patch("/admin/v1/tenants/demo-only", json={"allowed_models": []})
        assert narrowed.status_code == 200 and narrowed.json()["allowed_models"] == []
    with _client(two_models, key) as client:
        assert [m.id for m in client.models.list()] == []
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                max_tokens=2)


def test_a_keys_allowed_models_narrow_its_tenants(two_models: ServeProcess) -> None:
    """Two keys of one tenant that may use both models: the one limited to the demo model
    reaches only it (the same 404 as the tenant's own list gives); its list is changed through
    the admin API (at once on this replica) and the CLI (audited); a key's list never widens
    its tenant's."""
    wide = _tenant(two_models, "two-keys", None)
    with admin_client(two_models) as admin:
        created = admin.post("/admin/v1/tenants/two-keys/keys",
                             json={"name": "demo", "allowed_models": [DEMO_MODEL_NAME]})
        assert created.status_code == 201, created.text
        assert created.json()["allowed_models"] == [DEMO_MODEL_NAME]
        narrow, key_id = str(created.json()["key"]), created.json()["id"]
        bad = admin.patch(f"/admin/v1/keys/{key_id}", json={"allowed_models": "all"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_models"
    with _client(two_models, narrow) as client:
        assert [m.id for m in client.models.list()] == [DEMO_MODEL_NAME]
        with pytest.raises(openai.NotFoundError):
            _hi(client, DEFAULT_MODEL_NAME)
    with _client(two_models, wide) as client:
        assert sorted(m.id for m in client.models.list()) == sorted(
            [DEFAULT_MODEL_NAME, DEMO_MODEL_NAME])
    with admin_client(two_models) as admin:
        widened = admin.patch(f"/admin/v1/keys/{key_id}", json={"allowed_models": None})
        assert widened.status_code == 200 and widened.json()["allowed_models"] is None
    with _client(two_models, narrow) as client:
        assert _hi(client, DEFAULT_MODEL_NAME).model == DEFAULT_MODEL_NAME
    shown = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", "models", str(key_id), DEFAULT_MODEL_NAME,
         "--database-url", two_models.database_url, "--json"],
        check=True, capture_output=True, text=True, timeout=60)
    assert json.loads(shown.stdout)["allowed_models"] == [DEFAULT_MODEL_NAME]
    with admin_client(two_models) as admin:
        audit = admin.get("/admin/v1/audit", params={"target_type": "api_key",
                                                      "target_id": key_id}).json()["data"]
        updates = [entry for entry in audit if entry["action"] == "api_key.update"]
        assert [entry["after"]["allowed_models"] for entry in updates] == [
            [DEFAULT_MODEL_NAME], None]  # newest first
        assert all("key" not in entry["after"] for entry in audit)  # never a secret
        # A demo-only tenant's key listing the default model reaches no model at all.
        demo_only = admin.post("/admin/v1/tenants",
                               json={"name": "demo-tenant", "allowed_models": [DEMO_MODEL_NAME]})
        assert demo_only.status_code == 201
        key = admin.post("/admin/v1/tenants/demo-tenant/keys",
                         json={"allowed_models": [DEFAULT_MODEL_NAME]}).json()["key"]
    with _client(two_models, key) as client:
        assert [m.id for m in client.models.list()] == []
        with pytest.raises(openai.NotFoundError):
            _hi(client, DEFAULT_MODEL_NAME)


def test_a_model_that_fails_to_load_leaves_the_other_serving(tmp_path: Path) -> None:
    missing = tmp_path / "gone"
    server = ServeProcess(f"sqlite:///{tmp_path / 'db'}",
                          args=["--model", str(missing), "--model", "demo"])
    with server.start():
        ready = httpx.get(f"{server.base_url}/health/ready", timeout=30)
        assert ready.status_code == 200
        assert ready.json()["models"] == {"gone": "failed", DEMO_MODEL_NAME: "up"}
        assert httpx.get(f"{server.base_url}/health/live", timeout=30).status_code == 200
        assert _engine_up(server) == {"gone": 0.0, DEMO_MODEL_NAME: 1.0}
        key = _tenant(server, "acme", None)
        with _client(server, key) as client:
            assert [m.id for m in client.models.list()] == [DEMO_MODEL_NAME]
            with pytest.raises(openai.InternalServerError) as unavailable:
                client.chat.completions.create(
                    model="gone", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert unavailable.value.status_code == 503
            assert "failed to load" in unavailable.value.message
            assert client.chat.completions.create(
                model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                max_tokens=2).model == DEMO_MODEL_NAME
    assert "loading the model gone failed" in server.output()
