"""API keys that expire (set through the admin API or the CLI, refused with a 401 naming the
expiry from the moment it passes, a cached key included; bad expiries refused) and rotate
(a new secret under the same key id, the old one working on every replica until the grace
ends, then only the new one)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import openai
import pytest

from gateway.server.model_source import DEMO_MODEL_NAME
from tests.gateway.app_harness import start_gateway


def test_an_expired_key_gets_a_401_naming_its_expiry(tmp_path: Path) -> None:
    with start_gateway(tmp_path) as gateway, gateway.admin() as admin:
        assert admin.post("/admin/v1/tenants", json={"name": "acme"}).status_code == 201
        expires_at = datetime.now(UTC) + timedelta(seconds=2)
        created = admin.post("/admin/v1/tenants/acme/keys",
                             json={"name": "short", "expires_at": expires_at.isoformat()})
        assert created.status_code == 201, created.text
        assert datetime.fromisoformat(created.json()["expires_at"]) == expires_at
        client = gateway.openai_client(created.json()["key"])
        reply = client.chat.completions.create(
            model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.choices  # cached from now on, for 5 s: past the expiry
        time.sleep(max(0.0, (expires_at - datetime.now(UTC)).total_seconds()) + 0.1)
        with pytest.raises(openai.AuthenticationError) as expired:
            client.models.list()
        assert expired.value.code == "api_key_expired"
        assert f"expired at {expires_at.isoformat(timespec='seconds')}" in expired.value.message

        for bad, message in (
                ("2020-01-01T00:00:00Z", "must be in the future"),
                ("2099-01-01T00:00:00", "with its time zone"),
                ("next week", "ISO 8601")):
            refused = admin.post("/admin/v1/tenants/acme/keys", json={"expires_at": bad})
            assert refused.status_code == 400, bad
            assert message in refused.json()["error"]["message"]
            assert refused.json()["error"]["param"] == "expires_at"
        assert len(admin.get("/admin/v1/tenants/acme/keys").json()["data"]) == 1

        database = gateway.runtime.settings.database_url
        made = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "keys", "create", "acme", "--name", "cli",
             "--expires-in-days", "30", "--database-url", database, "--json"],
            capture_output=True, text=True, check=True, timeout=60)
        expiry = datetime.fromisoformat(json.loads(made.stdout)["expires_at"])
        assert timedelta(days=29.9) < expiry - datetime.now(UTC) < timedelta(days=30.1)


def test_rotation_keeps_the_old_secret_for_its_grace_on_every_replica(tmp_path: Path) -> None:
    database = f"sqlite:///{tmp_path / 'shared.db'}"
    with start_gateway(tmp_path / "a", database_url=database) as first, \
            start_gateway(tmp_path / "b", database_url=database) \
            as second, first.admin() as admin:
        assert admin.post("/admin/v1/tenants", json={"name": "acme"}).status_code == 201
        created = admin.post("/admin/v1/tenants/acme/keys", json={"name": "ci"}).json()
        old = created["key"]
        for gateway in (first, second):  # the old secret now in both replicas' caches
            assert gateway.openai_client(old).models.list().data
        grace_s = 3
        rotated = admin.post(f"/admin/v1/keys/{created['id']}/rotate",
                             json={"grace_seconds": grace_s})
        assert rotated.status_code == 200, rotated.text
        new = rotated.json()["key"]
        assert rotated.json()["id"] == created["id"] and new != old
        ends = datetime.fromisoformat(rotated.json()["previous_expires_at"])
        for gateway in (first, second):
            assert gateway.openai_client(old).models.list().data
            assert gateway.openai_client(new).models.list().data
        # Past the grace and the replicas' key cache (5 s): only the new secret.
        time.sleep(max(0.0, (ends - datetime.now(UTC)).total_seconds()) + 5.2)
        for gateway in (first, second):
            with pytest.raises(openai.AuthenticationError) as expired:
                gateway.openai_client(old).models.list()
            assert "was rotated and its old secret expired at" in expired.value.message
            assert gateway.openai_client(new).models.list().data
        bad = admin.post(f"/admin/v1/keys/{created['id']}/rotate", json={"grace_seconds": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "grace_seconds"
        actions = [e["action"] for e in admin.get("/admin/v1/audit").json()["data"]]
        assert actions.count("api_key.rotate") == 1
