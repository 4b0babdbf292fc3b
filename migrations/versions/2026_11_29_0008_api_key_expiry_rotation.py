"""API keys that expire (api_keys.expires_at, NULL: never) and rotate (the previous secret's
prefix, hash and end of grace)

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29 17:30:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("previous_prefix", sa.String(16), nullable=True))
        batch.add_column(sa.Column("previous_key_hash", sa.String(64), nullable=True))
        batch.add_column(sa.Column("previous_expires_at", sa.DateTime(timezone=True),
                                   nullable=True))
        batch.create_unique_constraint("uq_api_keys_previous_prefix", ["previous_prefix"])


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_constraint("uq_api_keys_previous_prefix", type_="unique")
        for column in ("previous_expires_at", "previous_key_hash", "previous_prefix",
                       "expires_at"):
            batch.drop_column(column)
