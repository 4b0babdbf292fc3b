"""A request's RequestRecord (gateway.openai.request_record), built once it is over, whether it
ran or was refused: what it is billed for (its tokens, the engine's metering of its GPU
seconds, the tenant charged the recompute after a preemption) and its timings; and what its
trace's span is told of it (trace_response)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from engine import RequestMetrics
from gateway.access.auth import TenantPrincipal
from gateway.observability.telemetry import GenAiResponse
from gateway.openai.generation import JobSummary
from gateway.openai.request_record import RequestEnd, RequestRecord
from gateway.openai.requests import Endpoint

__all__ = ["build_record", "trace_response"]


def build_record(
    request_id: str,
    principal: TenantPrincipal,
    model: str,
    endpoint: Endpoint,
    status: RequestEnd,
    summary: JobSummary,
    *,
    arrival: float,
    http_status: int,
    created_at: datetime | None = None,
    metrics: Sequence[RequestMetrics] = (),
    token_times: Sequence[Sequence[float]] = (),
    first_token_time: float | None = None,
    refusal_reason: str | None = None,
    adapter: str | None = None,
    weight_format: str | None = None,
) -> RequestRecord:
    """The record of a request once it is over.

    summary: its token counts (a refused request: the prompt tokens it was found to hold).
    arrival, first_token_time and token_times are monotonic seconds: token_times, per choice,
    when its outputs that carried tokens arrived. metrics: the engine's latest metering of
    each choice that ran. created_at: when it was admitted (None: when it ended, for a
    refusal). http_status: what the client got. adapter: the LoRA adapter it ran on;
    weight_format: the served model's (None for a refusal: nothing ran).
    """
    now = time.monotonic()
    finished_at = datetime.now(UTC)
    reasons = {r for r in summary.finish_reasons if r is not None}
    finish_reason = (
        None if not reasons else "length" if reasons == {"length"}
        else "stop" if reasons <= {"stop", "length"} else sorted(reasons)[0]
    )
    gaps = [(times[-1] - times[0]) / (len(times) - 1) for times in token_times if len(times) >= 2]
    inter_token_gaps = tuple(
        later - earlier for times in token_times for earlier, later in itertools.pairwise(times)
    )
    queue_times = [m.queue_time_s for m in metrics if m.queue_time_s is not None]
    return RequestRecord(
        request_id=request_id,
        tenant_id=principal.tenant_id,
        api_key_id=principal.api_key_id,
        model=model,
        tier=principal.tier,
        endpoint=endpoint,
        status=status,
        finish_reason=finish_reason,
        num_prompt_tokens=summary.num_prompt_tokens,
        num_cached_prompt_tokens=summary.num_cached_prompt_tokens,
        num_completion_tokens=summary.num_completion_tokens,
        gpu_seconds=sum((m.gpu_seconds for m in metrics), 0.0),
        recompute_gpu_seconds=sum((m.recompute_gpu_seconds for m in metrics), 0.0),
        recompute_charged_tenant_id=_most_charged_tenant(metrics) or None,
        num_preemptions=summary.num_preemptions,
        queue_time_s=max(queue_times) if queue_times else None,
        ttft_s=None if first_token_time is None else first_token_time - arrival,
        e2e_time_s=now - arrival,
        tpot_s=sum(gaps) / len(gaps) if gaps else None,
        inter_token_gaps_s=inter_token_gaps,
        created_at=finished_at if created_at is None else created_at,
        finished_at=finished_at,
        http_status=http_status,
        refusal_reason=refusal_reason,
        grammar_compile_s=sum((m.grammar_compile_s for m in metrics), 0.0),
        adapter=adapter,
        weight_format=weight_format,
    )


def _most_charged_tenant(metrics: Sequence[RequestMetrics]) -> int | None:
    """The tenant charged the most recompute over the request's samples."""
    charges: dict[str, float] = {}
    for m in metrics:
        for tenant_id, seconds in m.recompute_gpu_seconds_by_tenant.items():
            charges[tenant_id] = charges.get(tenant_id, 0.0) + seconds
    if not charges:
        return None
    return int(max(charges, key=lambda tenant_id: charges[tenant_id]))


def trace_response(record: RequestRecord, model: str) -> GenAiResponse:
    """The response attributes of the request's span."""
    error_type = {
        RequestEnd.FAILED: "engine_error",
        RequestEnd.ABORTED: "client_disconnected",
        RequestEnd.REFUSED: record.refusal_reason or "refused",
    }.get(record.status)
    return GenAiResponse(
        response_id=record.request_id if record.status is not RequestEnd.REFUSED else None,
        response_model=model,
        finish_reasons=[record.finish_reason] if record.finish_reason else [],
        num_input_tokens=record.num_prompt_tokens,
        num_output_tokens=record.num_completion_tokens,
        num_cached_input_tokens=record.num_cached_prompt_tokens,
        error_type=error_type,
    )
