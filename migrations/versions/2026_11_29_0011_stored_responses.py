"""Responses kept for retrieval and previous_response_id (stored_responses: the response body
and the conversation it ends, per tenant, until its retention ends)

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-29 23:05:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("previous_response_id", sa.String(64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("conversation", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_stored_responses"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name="fk_stored_responses_tenant_id_tenants",
                                ondelete="CASCADE"),
    )
    op.create_index("ix_stored_responses_tenant_id", "stored_responses", ["tenant_id"])
    op.create_index("ix_stored_responses_expires_at", "stored_responses", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_stored_responses_expires_at", table_name="stored_responses")
    op.drop_index("ix_stored_responses_tenant_id", table_name="stored_responses")
    op.drop_table("stored_responses")
