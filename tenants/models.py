"""SQLAlchemy models of tenants, their quotas, API keys, LoRA adapters and the admin audit
log.

The schema itself comes only from migrations/; these classes must match it, which
tests/tenants/test_migrations.py checks by comparing them with the migrated database.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Enum,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    String,
    TypeDecorator,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Explicit constraint names, so migrations can drop them by name on both backends.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utc_now() -> datetime:
    return datetime.now(UTC)


class UtcDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python, on SQLite as on PostgreSQL."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime; use an aware UTC timestamp")
        value = value.astimezone(UTC)
        # SQLite has no time zone type: store UTC wall time.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class TenantStatus(enum.StrEnum):
    ACTIVE = "active"
    DISABLED = "disabled"


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (CheckConstraint("weight > 0", name="weight_positive"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Unique, human-chosen; starts with a letter so it never reads as an id.
    name: Mapped[str] = mapped_column(String(64), unique=True)
    # One of the deployment's tier names (premium, standard, batch by default).
    tier: Mapped[str] = mapped_column(String(32))
    # Fair-share weight inside the tier: a tenant with weight 2 gets twice the tokens.
    weight: Mapped[float] = mapped_column(Float)
    status: Mapped[TenantStatus] = mapped_column(
        Enum(
            TenantStatus,
            native_enum=False,
            length=16,
            values_callable=lambda members: [m.value for m in members],
        )
    )
    # Mixed into prefix-cache block hashes so tenants never share cached KV blocks.
    cache_salt: Mapped[str] = mapped_column(String(64))
    # The served model names (base models) its requests may name, adapters of them included;
    # NULL: every model.
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utc_now)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utc_now, onupdate=utc_now)

    quota: Mapped[Quota] = relationship(
        back_populates="tenant", cascade="all, delete-orphan", lazy="joined"
    )
    api_keys: Mapped[list[ApiKey]] = relationship(
        back_populates="tenant", cascade="all, delete-orphan", passive_deletes=True
    )

    @property
    def is_active(self) -> bool:
        return self.status is TenantStatus.ACTIVE


class Quota(Base):
    """A tenant's limits; NULL in any column means unlimited."""

    __tablename__ = "tenant_quotas"
    __table_args__ = (
        CheckConstraint(
            "kv_cap_share IS NULL OR (kv_cap_share > 0 AND kv_cap_share <= 1)",
            name="kv_cap_share_range",
        ),
        CheckConstraint(
            "requests_per_minute >= 0 AND tokens_per_minute >= 0"
            " AND max_concurrent_requests >= 0 AND max_queued_requests >= 0"
            " AND monthly_token_budget >= 0 AND monthly_spend_budget_usd_micros >= 0",
            name="counts_not_negative",
        ),
        CheckConstraint("burst_requests >= 0 AND burst_tokens >= 0", name="bursts_not_negative"),
        CheckConstraint("file_storage_bytes >= 0", name="file_storage_not_negative"),
    )

    tenant_id: Mapped[int] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    # Prompt plus max_tokens reserved at admission, refunded when unused.
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    # Bucket capacities (how much may be spent at once); NULL: one minute's worth.
    burst_requests: Mapped[int | None] = mapped_column(Integer)
    burst_tokens: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer)
    max_queued_requests: Mapped[int | None] = mapped_column(Integer)
    # Most of the KV block pool this tenant may hold at once, in (0, 1].
    kv_cap_share: Mapped[float | None] = mapped_column(Float)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)
    # Whole micro-dollars (1 USD = 1_000_000), exact on every backend.
    monthly_spend_budget_usd_micros: Mapped[int | None] = mapped_column(BigInteger)
    # Most bytes its uploaded files (the Files API) may hold together.
    file_storage_bytes: Mapped[int | None] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utc_now, onupdate=utc_now)

    tenant: Mapped[Tenant] = relationship(back_populates="quota")


class ApiKey(Base):
    """A tenant's API key; the plaintext is never stored, only its lookup prefix and hash."""

    __tablename__ = "api_keys"
    __table_args__ = (
        CheckConstraint(
            "requests_per_minute >= 0 AND tokens_per_minute >= 0"
            " AND monthly_token_budget >= 0 AND monthly_spend_budget_usd_micros >= 0",
            name="limits_not_negative",
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    # Public part of the key ("tg-" + 8 characters), unique, used to find the row.
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    # SHA-256 hex digest of the whole key.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utc_now)
    # Updated when a replica loads the key into its cache, so accurate to the cache TTL.
    last_used_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    # After this the key is refused (401 naming its expiry); NULL: never.
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    # The secret before the last rotation, valid until previous_expires_at (its grace).
    previous_prefix: Mapped[str | None] = mapped_column(String(16), unique=True)
    previous_key_hash: Mapped[str | None] = mapped_column(String(64))
    previous_expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    # The served models this key may use, within its tenant's (their intersection); NULL: the
    # tenant's.
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    # The key's own limits, each binding before its tenant's (both apply); NULL: only the
    # tenant's.
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)
    # Whole micro-dollars, as the tenant's.
    monthly_spend_budget_usd_micros: Mapped[int | None] = mapped_column(BigInteger)

    tenant: Mapped[Tenant] = relationship(back_populates="api_keys")

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    def is_expired(self, now: datetime) -> bool:
        return self.expires_at is not None and now >= self.expires_at


class LoraAdapterBlob(Base):
    """An adapter's files, once per content: what a replica writes to its local cache the
    first time a request needs the adapter (so replicas share no filesystem)."""

    __tablename__ = "lora_adapter_blobs"

    # SHA-256 hex digest over the config's and the weights' bytes (gateway.adapters.store).
    content_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    config_json: Mapped[bytes] = mapped_column(LargeBinary)
    weights: Mapped[bytes] = mapped_column(LargeBinary)


class LoraAdapter(Base):
    """A tenant's LoRA adapter: requests name it as their model; it is visible to its owner
    and the tenants it is shared with, and to nobody else."""

    __tablename__ = "lora_adapters"
    __table_args__ = (CheckConstraint("rank > 0", name="rank_positive"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Unique, the `model` requests send (or "<base model>:<name>"); same rules as tenant names.
    name: Mapped[str] = mapped_column(String(64), unique=True)
    # The served model name it was checked against and runs on.
    base_model: Mapped[str] = mapped_column(String(128))
    owner_tenant_id: Mapped[int] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    content_hash: Mapped[str] = mapped_column(
        ForeignKey("lora_adapter_blobs.content_hash"), index=True)
    rank: Mapped[int] = mapped_column(Integer)
    targets: Mapped[list[str]] = mapped_column(JSON)  # HF module names it adapts
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    # Kept in the engines' host caches once loaded, whatever their LRU says.
    pinned: Mapped[bool] = mapped_column(Boolean, server_default=false())
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utc_now)
    # Set when unregistering starts: no new request may use it; the row goes once the
    # requests running on it have ended.
    deleted_at: Mapped[datetime | None] = mapped_column(UtcDateTime)

    grants: Mapped[list[LoraAdapterGrant]] = relationship(
        back_populates="adapter", cascade="all, delete-orphan", lazy="selectin",
        passive_deletes=True)

    @property
    def shared_with(self) -> list[int]:
        return sorted(grant.tenant_id for grant in self.grants)


class LoraAdapterGrant(Base):
    """A tenant other than the owner that may use an adapter."""

    __tablename__ = "lora_adapter_grants"

    adapter_id: Mapped[int] = mapped_column(
        ForeignKey("lora_adapters.id", ondelete="CASCADE"), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True, index=True)

    adapter: Mapped[LoraAdapter] = relationship(back_populates="grants")


class AuditEntry(Base):
    """One admin action: who did what to which row, and the row before and after."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    occurred_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utc_now, index=True)
    # "admin-api:<client address>" or "cli:<os user>".
    actor: Mapped[str] = mapped_column(String(128))
    # Dotted verb, e.g. "tenant.create", "tenant.disable", "api_key.revoke".
    action: Mapped[str] = mapped_column(String(64))
    target_type: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str] = mapped_column(String(64))
    before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class StoredResponse(Base):
    """A Responses API response kept (its `store` was true) for retrieval and for a later
    request's previous_response_id, visible to its tenant only, until expires_at."""

    __tablename__ = "stored_responses"

    # "resp_" + 32 hex digits, as the API returned it.
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    model: Mapped[str] = mapped_column(String(256))
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utc_now)
    # Created plus the deployment's retention; purged after.
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    # The response object as the API returned it.
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The chat messages this response ends (previous turns, this input, this output), without
    # the instructions: what a request naming it as previous_response_id continues.
    conversation: Mapped[list[dict[str, Any]]] = mapped_column(JSON)


class AdminRole(enum.StrEnum):
    """What an admin credential may do; the admin API maps each route to the least role it
    needs (gateway.admin.roles). billing and operator each add to read-only, owner has all."""

    READ_ONLY = "read-only"
    BILLING = "billing"
    OPERATOR = "operator"
    OWNER = "owner"


class AdminCredential(Base):
    """A named secret that opens the admin API with one role; like tenant keys only its
    public lookup prefix and SHA-256 are stored."""

    __tablename__ = "admin_credentials"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Who or what holds it ("ci-export", "alice"); named in the audit log's actor.
    name: Mapped[str] = mapped_column(String(128))
    role: Mapped[AdminRole] = mapped_column(
        Enum(
            AdminRole,
            native_enum=False,
            length=16,
            values_callable=lambda members: [m.value for m in members],
        )
    )
    # Public part of the secret ("tga-" + 8 characters), unique, used to find the row.
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    # SHA-256 hex digest of the whole secret.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utc_now)
    # Refused from then on (by each replica within its credential cache's TTL).
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    # Updated when a replica loads the credential into its cache, so accurate to the TTL.
    last_used_at: Mapped[datetime | None] = mapped_column(UtcDateTime)

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None


class StoredFile(Base):
    """A file a tenant uploaded through the Files API; its bytes are in the deployment's file
    storage (gateway.files) under its id. Visible to its tenant only."""

    __tablename__ = "files"
    __table_args__ = (
        CheckConstraint("bytes >= 0 AND num_lines >= 0", name="sizes_not_negative"),
    )

    # "file-" + 24 hex digits, as the API returns it.
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    filename: Mapped[str] = mapped_column(String(256))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    num_lines: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utc_now)


class Batch(Base):
    """A tenant's batch (the Batches API): the requests of one input file, run in the batch
    tier by whichever replicas claim its lines, until it completes, fails, expires or is
    cancelled."""

    __tablename__ = "batches"

    # "batch_" + 32 hex digits.
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # The key that created it: its lines run under that key's limits and models.
    api_key_id: Mapped[int | None] = mapped_column(Integer)
    endpoint: Mapped[str] = mapped_column(String(64))  # "/v1/chat/completions", ...
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    # validating, in_progress, finalizing, completed, failed, expired, cancelling, cancelled
    status: Mapped[str] = mapped_column(String(16), index=True)
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    # Why it failed or stopped: [{"code", "message", "line"}].
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    total: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, default=utc_now)
    # The end of its completion window: lines not run by then end as batch_expired.
    expires_at: Mapped[datetime] = mapped_column(UtcDateTime)
    in_progress_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    finalizing_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    failed_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    expired_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    cancelling_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UtcDateTime)


class BatchLine(Base):
    """One request of a batch: pending until a replica claims it (for a lease it renews while
    the request runs; another replica takes it over once the lease lapses), then done with
    its output or error line."""

    __tablename__ = "batch_lines"

    batch_id: Mapped[str] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    line_index: Mapped[int] = mapped_column(Integer, primary_key=True)  # 0-based, in the file
    custom_id: Mapped[str] = mapped_column(String(512))
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The start of its prompt: lines are claimed in this order, so those sharing a prefix
    # run together and hit the prefix cache.
    prefix_key: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), index=True)  # pending, running, done
    claimed_by: Mapped[str | None] = mapped_column(String(64))
    claim_expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    # Not claimed again before this (a line refused for the moment, e.g. rate-limited).
    not_before: Mapped[datetime | None] = mapped_column(UtcDateTime)
    # Runs that ended in a server error (retried up to a limit, then an error line).
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    is_error: Mapped[bool] = mapped_column(Boolean, default=False)
    # Its line of the output file (is_error false) or of the error file.
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
