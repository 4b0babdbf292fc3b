"""The usage_records table, on the tenants metadata so one set of migrations covers both.

No foreign key to tenants: records must outlive the tenant they bill (invoices, audits,
disputes come after a tenant is deleted), and a ledger write must never fail because a tenant
was deleted while its last request was running. tenant_id is a plain integer for the same
reason; exports join tenants only to show the name, when the tenant still exists.

The request id is the primary key: the ledger's idempotency key, so a replayed record is
skipped by ``ON CONFLICT (request_id) DO NOTHING``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, CheckConstraint, Enum, Float, Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from billing.records import (
    MAX_ADAPTER_LENGTH,
    MAX_FINISH_REASON_LENGTH,
    MAX_MODEL_LENGTH,
    MAX_REQUEST_ID_LENGTH,
    MAX_TIER_LENGTH,
    MAX_WEIGHT_FORMAT_LENGTH,
    RECORD_FIELDS,
    RecordStatus,
    UsageRecord,
)
from tenants import Base, UtcDateTime


class UsageRecordRow(Base):
    """One UsageRecord as stored; see billing.records for what each column means."""

    __tablename__ = "usage_records"
    __table_args__ = (
        # Daily rollups and exports per tenant and month; monthly totals at first use.
        Index("ix_usage_records_tenant_id_finished_at", "tenant_id", "finished_at"),
        # Whole-month exports across tenants.
        Index("ix_usage_records_finished_at", "finished_at"),
        # Recompute charged to a tenant by other tenants' records.
        Index(
            "ix_usage_records_recompute_charged_tenant_id_finished_at",
            "recompute_charged_tenant_id",
            "finished_at",
        ),
        CheckConstraint(
            "num_prompt_tokens >= 0 AND num_cached_prompt_tokens >= 0"
            " AND num_completion_tokens >= 0 AND num_preemptions >= 0"
            " AND gpu_seconds >= 0 AND recompute_gpu_seconds >= 0"
            " AND amount_usd_micros >= 0 AND recompute_amount_usd_micros >= 0",
            name="counts_not_negative",
        ),
        CheckConstraint("num_requests >= 1", name="num_requests_positive"),
        CheckConstraint("grammar_compile_s >= 0", name="grammar_compile_s_non_negative"),
    )

    request_id: Mapped[str] = mapped_column(String(MAX_REQUEST_ID_LENGTH), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(Integer)
    api_key_id: Mapped[int | None] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(MAX_MODEL_LENGTH))
    tier: Mapped[str] = mapped_column(String(MAX_TIER_LENGTH))
    endpoint: Mapped[str] = mapped_column(String(32))
    status: Mapped[RecordStatus] = mapped_column(
        Enum(
            RecordStatus,
            native_enum=False,
            length=16,
            values_callable=lambda members: [m.value for m in members],
        )
    )
    finish_reason: Mapped[str | None] = mapped_column(String(MAX_FINISH_REASON_LENGTH))
    num_prompt_tokens: Mapped[int] = mapped_column(Integer)
    num_cached_prompt_tokens: Mapped[int] = mapped_column(Integer)
    num_completion_tokens: Mapped[int] = mapped_column(Integer)
    gpu_seconds: Mapped[float] = mapped_column(Float)
    recompute_gpu_seconds: Mapped[float] = mapped_column(Float)
    recompute_charged_tenant_id: Mapped[int | None] = mapped_column(Integer)
    num_preemptions: Mapped[int] = mapped_column(Integer)
    queue_time_s: Mapped[float | None] = mapped_column(Float)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    e2e_time_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    finished_at: Mapped[datetime] = mapped_column(UtcDateTime)
    amount_usd_micros: Mapped[int] = mapped_column(BigInteger)
    recompute_amount_usd_micros: Mapped[int] = mapped_column(BigInteger)
    num_requests: Mapped[int] = mapped_column(Integer, server_default="1")
    grammar_compile_s: Mapped[float] = mapped_column(Float, server_default="0")
    adapter: Mapped[str | None] = mapped_column(String(MAX_ADAPTER_LENGTH))
    # NULL: no weights ran (a refusal), or a row from before revision 0015.
    weight_format: Mapped[str | None] = mapped_column(String(MAX_WEIGHT_FORMAT_LENGTH))


USAGE_RECORDS = Base.metadata.tables[UsageRecordRow.__tablename__]
assert tuple(USAGE_RECORDS.columns.keys()) == RECORD_FIELDS, "columns and fields must match"


def record_values(record: UsageRecord) -> dict[str, Any]:
    """Bind parameters for a Core insert of record."""
    return {name: getattr(record, name) for name in RECORD_FIELDS}
