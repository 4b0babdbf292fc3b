"""The billing ledger seen from the gateway: every finished request becomes a priced usage
record (committed, or spooled, before the client sees its end; refusals folded a second at a
time), and the ledger's monthly totals feed the admission budgets."""

from __future__ import annotations

import logging

from billing import (
    LedgerUnavailableError,
    Pricing,
    RecordStatus,
    RefusalTally,
    UsageLedger,
    UsageRecord,
)
from gateway.openai.request_record import RequestEnd, RequestRecord
from policies import MonthlyUsage

logger = logging.getLogger(__name__)


def usage_record(record: RequestRecord) -> UsageRecord:
    """The ledger's record of a request (unpriced: amounts are set by Pricing.price).

    A refusal used nothing: its record carries no tokens, so it is neither priced nor
    counted against a monthly budget (the request's prompt size stays in the metrics).
    """
    is_refused = record.status is RequestEnd.REFUSED
    return UsageRecord(
        request_id=record.request_id,
        tenant_id=record.tenant_id,
        api_key_id=record.api_key_id,
        model=record.model,
        tier=record.tier,
        endpoint=record.endpoint.value,
        status=RecordStatus(record.status.value),
        finish_reason=record.finish_reason,
        num_prompt_tokens=0 if is_refused else record.num_prompt_tokens,
        num_cached_prompt_tokens=record.num_cached_prompt_tokens,
        num_completion_tokens=record.num_completion_tokens,
        gpu_seconds=record.gpu_seconds,
        recompute_gpu_seconds=record.recompute_gpu_seconds,
        recompute_charged_tenant_id=record.recompute_charged_tenant_id,
        num_preemptions=record.num_preemptions,
        queue_time_s=record.queue_time_s,
        ttft_s=record.ttft_s,
        e2e_time_s=record.e2e_time_s,
        created_at=record.created_at,
        finished_at=record.finished_at,
        amount_usd_micros=0,
        recompute_amount_usd_micros=0,
        grammar_compile_s=record.grammar_compile_s,
        adapter=record.adapter,
        weight_format=record.weight_format,
    )


class LedgerSink:
    """RecordSink: price the request and return once its record is durable; a refusal is
    folded into its key's record of the second (the refusal tally) and returns at once."""

    def __init__(self, ledger: UsageLedger, pricing: Pricing, tally: RefusalTally) -> None:
        self.ledger = ledger
        self.pricing = pricing
        self.tally = tally

    async def record(self, record: RequestRecord) -> None:
        usage = self.pricing.price(usage_record(record))
        if usage.status is RecordStatus.REFUSED:
            self.tally.add(usage)
        else:
            await self.ledger.record(usage)


class LedgerBudgets:
    """policies.MonthlyUsageSource over the ledger's running monthly totals.

    While the database is down and a tenant's month was never loaded, its usage is unknown:
    the request is admitted (budgets are enforced again as soon as the totals load) rather
    than failing every request of that tenant on a billing outage.
    """

    def __init__(self, ledger: UsageLedger) -> None:
        self.ledger = ledger

    async def monthly_usage(self, tenant_id: str) -> MonthlyUsage:
        try:
            usage = await self.ledger.monthly_usage(int(tenant_id))
        except LedgerUnavailableError:
            logger.warning("monthly usage of tenant %s unknown (database down)", tenant_id)
            return MonthlyUsage(num_tokens=0, spend_usd_micros=0)
        return MonthlyUsage(num_tokens=usage.num_tokens, spend_usd_micros=usage.spend_usd_micros)

    async def key_monthly_usage(self, api_key_id: str) -> MonthlyUsage:
        """An API key's own usage this month; unknown (0) while the database is down, as a
        tenant's."""
        try:
            usage = await self.ledger.key_monthly_usage(int(api_key_id))
        except LedgerUnavailableError:
            logger.warning("monthly usage of API key %s unknown (database down)", api_key_id)
            return MonthlyUsage(num_tokens=0, spend_usd_micros=0)
        return MonthlyUsage(num_tokens=usage.num_tokens, spend_usd_micros=usage.spend_usd_micros)
