"""API keys that expire: set through the admin API or the CLI, refused with a 401 naming the
expiry from the moment it passes (a cached key included), and bad expiries refused."""

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
