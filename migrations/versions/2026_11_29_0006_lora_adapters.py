"""LoRA adapters: the registry (owner, grants, files once per content) and the adapter a
usage record ran on

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29 13:30:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "lora_adapter_blobs",
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("config_json", sa.LargeBinary(), nullable=False),
        sa.Column("weights", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("content_hash", name="pk_lora_adapter_blobs"),
    )
    op.create_table(
        "lora_adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("base_model", sa.String(128), nullable=False),
        sa.Column("owner_tenant_id", sa.Integer(), nullable=False),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("targets", sa.JSON(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_lora_adapters"),
        sa.UniqueConstraint("name", name="uq_lora_adapters_name"),
        sa.ForeignKeyConstraint(["owner_tenant_id"], ["tenants.id"],
                                name="fk_lora_adapters_owner_tenant_id_tenants",
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["content_hash"], ["lora_adapter_blobs.content_hash"],
                                name="fk_lora_adapters_content_hash_lora_adapter_blobs"),
        sa.CheckConstraint("rank > 0", name="ck_lora_adapters_rank_positive"),
    )
    op.create_index("ix_lora_adapters_owner_tenant_id", "lora_adapters", ["owner_tenant_id"])
    op.create_index("ix_lora_adapters_content_hash", "lora_adapters", ["content_hash"])
    op.create_table(
        "lora_adapter_grants",
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("adapter_id", "tenant_id", name="pk_lora_adapter_grants"),
        sa.ForeignKeyConstraint(["adapter_id"], ["lora_adapters.id"],
                                name="fk_lora_adapter_grants_adapter_id_lora_adapters",
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name="fk_lora_adapter_grants_tenant_id_tenants",
                                ondelete="CASCADE"),
    )
    op.create_index("ix_lora_adapter_grants_tenant_id", "lora_adapter_grants", ["tenant_id"])
    # Every record before this one ran on the base model.
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(sa.Column("adapter", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("adapter")
    op.drop_index("ix_lora_adapter_grants_tenant_id", table_name="lora_adapter_grants")
    op.drop_table("lora_adapter_grants")
    op.drop_index("ix_lora_adapters_content_hash", table_name="lora_adapters")
    op.drop_index("ix_lora_adapters_owner_tenant_id", table_name="lora_adapters")
    op.drop_table("lora_adapters")
    op.drop_table("lora_adapter_blobs")
