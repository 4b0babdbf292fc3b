"""token-bucket burst sizes per tenant

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 09:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.add_column(sa.Column("burst_requests", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("burst_tokens", sa.BigInteger(), nullable=True))
        batch.create_check_constraint(
            op.f("ck_tenant_quotas_bursts_not_negative"),
            "burst_requests >= 0 AND burst_tokens >= 0",
        )


def downgrade() -> None:
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.drop_constraint(op.f("ck_tenant_quotas_bursts_not_negative"), type_="check")
        batch.drop_column("burst_tokens")
        batch.drop_column("burst_requests")
