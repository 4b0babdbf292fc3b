"""Files uploaded through the Files API (files: owner, name, purpose, size, lines, where its
bytes are stored) and each tenant's storage quota for them (tenant_quotas.file_storage_bytes;
NULL: unlimited)

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-29 23:40:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("filename", sa.String(256), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("num_lines", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"],
                                name="fk_files_tenant_id_tenants", ondelete="CASCADE"),
        sa.CheckConstraint("bytes >= 0 AND num_lines >= 0", name="ck_files_sizes_not_negative"),
    )
    op.create_index("ix_files_tenant_id", "files", ["tenant_id"])
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.add_column(sa.Column("file_storage_bytes", sa.BigInteger(), nullable=True))
        batch.create_check_constraint("file_storage_not_negative", "file_storage_bytes >= 0")


def downgrade() -> None:
    with op.batch_alter_table("tenant_quotas") as batch:
        batch.drop_constraint("file_storage_not_negative", type_="check")
        batch.drop_column("file_storage_bytes")
    op.drop_index("ix_files_tenant_id", table_name="files")
    op.drop_table("files")
