"""usage records: the time spent compiling a request's structured-output grammar

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27 20:30:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Every record before this one had no grammar.
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(
            sa.Column("grammar_compile_s", sa.Float(), server_default="0", nullable=False)
        )
        batch.create_check_constraint(op.f("ck_usage_records_grammar_compile_s_non_negative"),
                                      "grammar_compile_s >= 0")


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_constraint(op.f("ck_usage_records_grammar_compile_s_non_negative"),
                              type_="check")
        batch.drop_column("grammar_compile_s")
