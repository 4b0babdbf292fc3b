"""No tenant key reaches the server's logs, even at debug level, for requests that succeed,
fail authentication, or are refused."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.serve_process import ADMIN_TOKEN, ServeProcess


def test_served_requests_never_log_the_key(tmp_path: Path) -> None:
    with ServeProcess(
        f"sqlite:///{tmp_path / 'logs.db'}", args=["--log-level", "debug"]
    ).start() as server:
        admin = {"x-admin-token": ADMIN_TOKEN}
        tenant = httpx.post(f"{server.base_url}/admin/v1/tenants", headers=admin,
                            json={"name": "quiet", "tier": "standard"}).json()
        created = httpx.post(f"{server.base_url}/admin/v1/tenants/{tenant['id']}/keys",
                             headers=admin, json={"name": "k"}).json()
        key = created["key"]
        auth = {"authorization": f"Bearer {key}"}
        body = {"model": "tiergate-demo", "prompt": "hello", "max_tokens": 4}
        assert httpx.post(f"{server.base_url}/v1/completions", json=body, headers=auth
                          ).status_code == 200
        stream = httpx.post(f"{server.base_url}/v1/completions", headers=auth,
                            json={**body, "stream": True})
        assert stream.text.endswith("data: [DONE]\n\n")
        assert httpx.post(f"{server.base_url}/v1/completions", json={**body, "n": 0},
                          headers=auth).status_code == 400
        wrong = key[:-4] + "XXXX"
        assert httpx.get(f"{server.base_url}/v1/models",
                         headers={"authorization": f"Bearer {wrong}"}).status_code == 401
        assert httpx.post(f"{server.base_url}/admin/v1/keys/{created['id']}/revoke",
                          headers=admin).status_code == 200
        assert httpx.get(f"{server.base_url}/v1/models", headers=auth).status_code == 403
    output = server.output()
    assert "POST /v1/completions" in output  # debug logging was on
    secret = key.split("_", 1)[1]
    assert secret not in output and wrong.split("_", 1)[1] not in output
