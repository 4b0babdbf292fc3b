"""usage records: the billing ledger

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 12:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # No foreign key to tenants: records outlive the tenant they bill (billing/models.py).
    op.create_table(
        "usage_records",
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=True),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("tier", sa.String(32), nullable=False),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("num_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("num_cached_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("num_completion_tokens", sa.Integer(), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.Column("recompute_gpu_seconds", sa.Float(), nullable=False),
        sa.Column("recompute_charged_tenant_id", sa.Integer(), nullable=True),
        sa.Column("num_preemptions", sa.Integer(), nullable=False),
        sa.Column("queue_time_s", sa.Float(), nullable=True),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("e2e_time_s", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("amount_usd_micros", sa.BigInteger(), nullable=False),
        sa.Column("recompute_amount_usd_micros", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name="pk_usage_records"),
        sa.CheckConstraint(
            "num_prompt_tokens >= 0 AND num_cached_prompt_tokens >= 0"
            " AND num_completion_tokens >= 0 AND num_preemptions >= 0"
            " AND gpu_seconds >= 0 AND recompute_gpu_seconds >= 0"
            " AND amount_usd_micros >= 0 AND recompute_amount_usd_micros >= 0",
            name="ck_usage_records_counts_not_negative",
        ),
    )
    op.create_index(
        "ix_usage_records_tenant_id_finished_at", "usage_records", ["tenant_id", "finished_at"]
    )
    op.create_index("ix_usage_records_finished_at", "usage_records", ["finished_at"])
    op.create_index(
        "ix_usage_records_recompute_charged_tenant_id_finished_at",
        "usage_records",
        ["recompute_charged_tenant_id", "finished_at"],
    )


def downgrade() -> None:
    op.drop_index("ix_usage_records_recompute_charged_tenant_id_finished_at", "usage_records")
    op.drop_index("ix_usage_records_finished_at", "usage_records")
    op.drop_index("ix_usage_records_tenant_id_finished_at", "usage_records")
    op.drop_table("usage_records")
