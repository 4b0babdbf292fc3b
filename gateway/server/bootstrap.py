"""First run on an empty database: one demo tenant with one key, so the printed curl line
works at once. A database that holds any tenant is left alone and no key is printed."""

from __future__ import annotations

import json
import shlex
from collections.abc import Collection

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

import tenants
from tenants import Tenant

DEMO_TENANT_NAME = "demo"
DEMO_TENANT_TIER = "standard"
_ACTOR = "serve:bootstrap"


def create_demo_tenant_if_empty(
    session_factory: sessionmaker[Session], known_tiers: Collection[str]
) -> str | None:
    """The plaintext key of a new demo tenant, or None when the database has tenants. Two
    replicas racing on an empty database: one creates it, the other gets a conflict and
    prints nothing."""
    try:
        with session_factory.begin() as session:
            if session.scalar(select(func.count()).select_from(Tenant)):
                return None
            tier = DEMO_TENANT_TIER if DEMO_TENANT_TIER in known_tiers else sorted(known_tiers)[0]
            tenant = tenants.create_tenant(
                session, name=DEMO_TENANT_NAME, tier=tier, actor=_ACTOR, known_tiers=known_tiers
            )
            created = tenants.create_api_key(session, tenant, name="demo", actor=_ACTOR)
            return created.plaintext
    except tenants.DuplicateError:
        return None


def first_run_message(base_url: str, model: str, api_key: str) -> str:
    """What `tiergate serve` prints once ready after creating the demo tenant."""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    )
    curl = (
        f"curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-H 'Authorization: Bearer {api_key}' -d {shlex.quote(body)}"
    )
    return (
        f"\ntiergate is ready at {base_url}/v1 (model {model!r}).\n"
        f"Created tenant {DEMO_TENANT_NAME!r} with this API key (shown once, stored only as a "
        f"hash):\n\n    {api_key}\n\nTry it:\n\n{curl}\n"
    )
