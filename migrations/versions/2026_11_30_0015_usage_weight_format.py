"""usage records: the weight format a request ran on ("float32", "gguf-q4_1", "awq-int4")

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-30 12:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: what the records before this one ran on was not recorded, and
    # NULL (an empty cell in a CSV export) says so; a refusal, which ran on nothing, is NULL
    # too.
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(sa.Column("weight_format", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("weight_format")
