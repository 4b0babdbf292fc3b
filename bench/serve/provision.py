"""One tenant per workload tenant on the server under test, with its tier, weight 1 and no
quota (every limit unlimited, so only SLO shedding refuses) unless the caller gives one, and a
fresh API key each; through the admin API, so it works as well for a server the benchmark did
not start.

Server-side names are the workload's prefixed with `bench-`; a tenant left by an earlier run
is updated back to the tier and unlimited quota and given a new key.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from bench.serve.errors import ProvisionError
from tenants import QUOTA_FIELDS

__all__ = ["TENANT_PREFIX", "provision_tenants", "served_model_name"]

TENANT_PREFIX = "bench-"
_UNLIMITED_QUOTA = dict.fromkeys(QUOTA_FIELDS)


def provision_tenants(
    base_url: str,
    admin_token: str,
    tiers_by_tenant: Mapping[str, str],
    quotas: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, str]:
    """Workload tenant -> plaintext API key, creating or resetting each tenant; quotas: the
    limits of some tenants (the others, and every field not given, unlimited)."""
    keys: dict[str, str] = {}
    headers = {"x-admin-token": admin_token}
    with httpx.Client(base_url=base_url, headers=headers, timeout=30.0, trust_env=False) as admin:
        for tenant, tier in sorted(tiers_by_tenant.items()):
            name = TENANT_PREFIX + tenant
            quota = {**_UNLIMITED_QUOTA, **(quotas or {}).get(tenant, {})}
            body = {"tier": tier, "weight": 1.0, "quota": quota}
            created = admin.post("/admin/v1/tenants", json={"name": name, **body})
            if created.status_code == 409:
                created = admin.patch(f"/admin/v1/tenants/{name}", json=body)
            _check(created, f"creating tenant {name}")
            key = admin.post(f"/admin/v1/tenants/{name}/keys", json={"name": "bench"})
            _check(key, f"creating a key for {name}")
            keys[tenant] = str(key.json()["key"])
    return keys


def served_model_name(base_url: str, api_key: str) -> str:
    """The one model /v1/models lists."""
    with httpx.Client(timeout=30.0, trust_env=False) as client:
        response = client.get(
            f"{base_url}/v1/models", headers={"authorization": f"Bearer {api_key}"}
        )
    _check(response, "listing models")
    models = [m["id"] for m in response.json()["data"]]
    if len(models) != 1:
        raise ProvisionError(f"expected one served model, the server lists {models}")
    return str(models[0])


def _check(response: httpx.Response, doing: str) -> None:
    if response.status_code in (200, 201):
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    raise ProvisionError(f"{doing}: HTTP {response.status_code}: {message}")
