"""usage records: how many requests a record stands for (refusals are folded, a row a second)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-27 16:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Every record before this one stood for one request.
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(
            sa.Column("num_requests", sa.Integer(), server_default="1", nullable=False)
        )
        batch.create_check_constraint(op.f("ck_usage_records_num_requests_positive"),
                                      "num_requests >= 1")


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_constraint(op.f("ck_usage_records_num_requests_positive"), type_="check")
        batch.drop_column("num_requests")
