"""Models a tenant may use (a list of served model names, or NULL for every model), and
LoRA adapters pinned in the engines' host caches

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29 16:20:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("allowed_models", sa.JSON(), nullable=True))
    with op.batch_alter_table("lora_adapters") as batch:
        batch.add_column(sa.Column("pinned", sa.Boolean(), nullable=False,
                                   server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("lora_adapters") as batch:
        batch.drop_column("pinned")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("allowed_models")
