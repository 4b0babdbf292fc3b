"""After creating keys, no column of any table holds a key or its secret part."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy.orm import Session

import tenants
from tenants.keys import PREFIX_LENGTH


def test_no_plaintext_key_in_any_column_of_any_table(
    session: Session, stored_values: Callable[[], list[tuple[str, str, str]]]
) -> None:
    plaintexts = []
    for i in range(3):
        tenant = tenants.create_tenant(session, name=f"t{i}", tier="batch", actor="test")
        for name in ("one", "two"):
            plaintexts.append(
                tenants.create_api_key(session, tenant, name=name, actor="test").plaintext
            )
    revoked = tenants.list_api_keys(session)[0]
    tenants.revoke_api_key(session, revoked, actor="test")
    session.commit()

    values = stored_values()
    tables = {table for table, _, _ in values}
    assert {"tenants", "tenant_quotas", "api_keys", "audit_log", "alembic_version"} <= tables
    # The scan sees the rows it should: every key's public prefix is stored.
    assert all(any(p[:PREFIX_LENGTH] in v for _, _, v in values) for p in plaintexts)
    for plaintext in plaintexts:
        secret = plaintext[PREFIX_LENGTH + 1 :]
        leaks = [(t, c) for t, c, v in values if plaintext in v or secret in v]
        assert leaks == [], f"key material stored in {leaks}"
