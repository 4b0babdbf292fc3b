"""An API key's own limits inside its tenant's (api_keys.requests_per_minute,
tokens_per_minute, monthly_token_budget, monthly_spend_budget_usd_micros; NULL: only the
tenant's)

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-29 23:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = (
    ("requests_per_minute", sa.Integer()),
    ("tokens_per_minute", sa.BigInteger()),
    ("monthly_token_budget", sa.BigInteger()),
    ("monthly_spend_budget_usd_micros", sa.BigInteger()),
)


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        for name, type_ in _COLUMNS:
            batch.add_column(sa.Column(name, type_, nullable=True))
        batch.create_check_constraint(
            "limits_not_negative",
            "requests_per_minute >= 0 AND tokens_per_minute >= 0"
            " AND monthly_token_budget >= 0 AND monthly_spend_budget_usd_micros >= 0",
        )


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_constraint("limits_not_negative", type_="check")
        for name, _type in reversed(_COLUMNS):
            batch.drop_column(name)
