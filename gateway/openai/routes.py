"""POST /v1/chat/completions, POST /v1/completions and GET /v1/models.

Order of work for a generation request: accepting (not draining, model loaded), the caller's
key, the screen (the tenant's rate limits have a request and a token left, read without
charging; for a body over LARGE_BODY_BYTES, its large bodies have not spent their share of
the loop's parse time: policies.parse_time), the body (size, JSON, schema and the
operator's bounds: messages, prompts x n), the model name, tokenization, the schema and
grammar checks (in the grammar worker, in the tenant's turn), whether it can ever fit the
context, admission, then the engine. A tenant out of quota is refused before its body is
read: it gets no parsing, tokenizing or checking for free. A large body's prompts are
tokenized off the event loop; a text that cannot fit the context is refused from its size,
before it is encoded. A request refused with a 4xx once its tenant is
known costs that tenant one request and the prompt tokens it was found to hold, taken from
its buckets as far as they go: bad requests are rate-limited like good ones. Nothing else is
charged or queued before every check that can refuse it has passed. A finished request's
record reaches the ledger before the client sees its final chunk (or its body), so a client
that saw the end is always billed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Message, Receive, Scope, Send

from engine import RequestErrorCode, RequestMetrics, RequestOutput
from gateway.access.admission import AdmissionGrant, AdmissionRefusal, GatewayAdmission
from gateway.access.auth import TenantPrincipal
from gateway.http.errors import (
    BadRequestError,
    GatewayError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    error_body,
)
from gateway.http.json_body import declared_length, parse_json_body
from gateway.http.protocol import abort_connection
from gateway.observability.telemetry import GenAiRequest, GenAiResponse, RequestTrace
from gateway.openai.generation import (
    MAX_UNREAD_OUTPUTS_PER_CHOICE,
    ChoiceState,
    GenerationJob,
    check_constraints,
    check_fits,
    prepare_prompts,
    sampling_params,
)
from gateway.openai.request_record import RequestEnd, RequestRecord
from gateway.openai.requests import (
    Endpoint,
    GenerationRequest,
    RequestBounds,
    parse_chat_request,
    parse_completion_request,
)
from gateway.openai.responses import ChoiceText, ResponseContext, chunk, full_response, usage_chunk
from gateway.openai.tool_calls import StreamedToolCalls
from gateway.server.runtime import GatewayRuntime, RecordLostError
from gateway.server.served_model import ServedModel, tenant_context
from policies import RefusalReason, Tier

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
# A large body refused before it is read (its tenant's rate limits spent) is answered after
# its retry delay, up to this long: a client sending such bodies back to back then costs the
# server a refusal a second per connection instead of hundreds, at no CPU while it waits.
SCREEN_HOLD_MAX_S = 1.0
# Refusals held at once, at most (past it they are answered at once): a client opening
# connection after connection holds a bounded number of them.
MAX_HELD_REFUSALS = 256


def openai_routes(runtime: GatewayRuntime, admission: GatewayAdmission) -> list[BaseRoute]:
    api = _OpenAIApi(runtime, admission)
    return [
        Route("/v1/models", api.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.get_model, methods=["GET"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
    ]


# Tool calls are read out of a reply this long (in characters) in a worker thread: the
# parse is linear, but a long reply's JSON is still milliseconds of work.
TOOL_PARSE_OFF_LOOP_CHARS = 64 << 10

# A body this large may hold prompts that take tens of milliseconds or more to tokenize: it
# is read only when the tenant's rate limits have room (AdmissionController.screen), and its
# prompts are rendered and tokenized in a worker thread instead of on the event loop.
LARGE_BODY_BYTES = 64 << 10


async def read_body(
    request: Request, max_bytes: int, on_large: Callable[[], Awaitable[None]] | None = None
) -> bytes:
    """The body's bytes; 413 above max_bytes (checked while reading). on_large runs once,
    before the body is read on, when it is found to be larger than LARGE_BODY_BYTES (a body
    that declares its size is screened before reading starts)."""
    declared = declared_length(request)
    if declared is not None and declared > max_bytes:
        raise PayloadTooLargeError(f"the request body is larger than {max_bytes} bytes")
    chunks, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > max_bytes:
            raise PayloadTooLargeError(f"the request body is larger than {max_bytes} bytes")
        if on_large is not None and size > LARGE_BODY_BYTES:
            await on_large()
            on_large = None
        chunks.append(piece)
    return b"".join(chunks)


class _OpenAIApi:
    def __init__(self, runtime: GatewayRuntime, admission: GatewayAdmission) -> None:
        self.runtime = runtime
        self.admission = admission
        self._encoder_limiter: anyio.CapacityLimiter | None = None
        self._num_held_refusals = 0
        settings = runtime.settings
        self._bounds = RequestBounds(settings.max_messages, settings.max_choices)

    async def list_models(self, request: Request) -> Response:
        await self.runtime.key_resolver.authenticate(request)
        served, _ = self.runtime.ready_model()
        return JSONResponse({"object": "list", "data": [_model_card(served)]})

    async def get_model(self, request: Request) -> Response:
        await self.runtime.key_resolver.authenticate(request)
        served, _ = self.runtime.ready_model()
        if request.path_params["model"] != served.name:
            raise _unknown_model(request.path_params["model"])
        return JSONResponse(_model_card(served))

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, Endpoint.CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def _generate(self, http_request: Request, endpoint: Endpoint) -> Response:
        arrival = time.monotonic()
        served, engine = self.runtime.ready_model()
        principal = await self.runtime.key_resolver.authenticate(http_request)
        settings = self.runtime.settings
        num_prompt_tokens = 0  # what a refused request is found to hold, charged to it
        declared = declared_length(http_request)
        # Before any of the body is read: a tenant out of requests or tokens, or (for a large
        # body) out of its share of the loop's parse time, is refused without costing more.
        await self._screen(principal, endpoint, served, arrival,
                           is_large=declared is not None and declared > LARGE_BODY_BYTES,
                           may_be_large=declared is None or declared > LARGE_BODY_BYTES)
        try:
            raw = await read_body(
                http_request,
                settings.max_body_bytes,
                on_large=None if declared is not None else lambda: self._screen(
                    principal, endpoint, served, arrival, is_large=True, may_be_large=True,
                    check_limits=False),
            )
            body_bytes = len(raw)
            started = time.perf_counter()
            try:
                parsed = (
                    parse_chat_request(parse_json_body(raw), self._bounds)
                    if endpoint is Endpoint.CHAT
                    else parse_completion_request(parse_json_body(raw), self._bounds)
                )
            finally:
                if body_bytes > LARGE_BODY_BYTES:
                    self.admission.spend_parse_time(principal, time.perf_counter() - started)
            del raw
            if parsed.model != served.name:
                raise _unknown_model(parsed.model)
            _check_tier_allows(parsed, self.runtime.tiers[principal.tier])
            # A small body's prompts are tokenized on the event loop: the hand-over to a thread
            # cost a request up to 16 ms before admission under 2x load on the CPU benchmark.
            # A large body's go to a thread whose encoder releases the GIL (1 MiB of text: about
            # a second of encoding, during which the loop serves every other tenant).
            off_loop = self._encoder_threads() if body_bytes > LARGE_BODY_BYTES else None
            prompts = await prepare_prompts(parsed, served, off_loop)
            num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
            params = sampling_params(parsed, served)
            await check_constraints(parsed, params, served, principal.cache_salt)
            tenant = tenant_context(
                served,
                self.runtime.tiers,
                tenant_id=principal.tenant_id,
                tier=principal.tier,
                weight=principal.weight,
                cache_salt=principal.cache_salt,
                kv_cap_share=principal.quota.kv_cap_share,
                scheduling=settings.scheduling,
            )
            max_tokens = check_fits(engine, prompts, params, tenant, endpoint)
        except ClientDisconnect:
            return Response(status_code=499)
        except AdmissionRefusal:  # the screen's 429: refused before any work, not charged
            raise
        except GatewayError as error:
            if 400 <= error.status_code < 500:
                # A bad request costs its tenant like a good one, so a tenant cannot make the
                # gateway parse and tokenize without limit by sending what it will refuse.
                await self.admission.charge_refused(principal, num_prompt_tokens)
            raise
        response_id = _response_id(endpoint)
        trace = self.runtime.telemetry.start_request(
            GenAiRequest(
                operation=_operation(endpoint),
                request_model=parsed.model,
                tier=principal.tier,
                tenant_id=str(principal.tenant_id),
                max_tokens=parsed.sampling.max_tokens,
                temperature=parsed.sampling.temperature,
                top_p=parsed.sampling.top_p,
                seed=parsed.sampling.seed,
                num_choices=params.n * len(prompts),
                is_stream=parsed.stream,
            ),
            start_s=arrival,
        )
        try:
            with trace.admission():
                grant = await self.admission.admit(
                    principal,
                    num_prompt_tokens=num_prompt_tokens,
                    num_max_tokens=params.n * sum(max_tokens),
                )
        except AdmissionRefusal as refusal:
            if refusal.reason == RefusalReason.SHED:  # demand all the same (policies.tenant_demand)
                for prompt in prompts:
                    engine.record_refused(len(prompt.token_ids), tenant)
            record = refused_record(
                response_id, principal, endpoint, served, num_prompt_tokens, arrival, refusal
            )
            trace.finished(_trace_response(record, served))
            await self.runtime.publish(record)  # counted, not written: no wait on the ledger
            raise
        trace.queued()
        job = GenerationJob(engine, response_id, prompts, params, tenant)
        run = _Run(self, served, principal, parsed, job, grant, arrival, trace)
        self.runtime.request_started()
        if parsed.stream:
            return _EventStream(
                run.stream(), settings.stream_write_timeout_s,
                headers={**_SSE_HEADERS, **grant.headers},
            )
        return await run.respond(http_request)

    async def _screen(
        self, principal: TenantPrincipal, endpoint: Endpoint, served: ServedModel,
        arrival: float, *, is_large: bool, may_be_large: bool, check_limits: bool = True,
    ) -> None:
        """Before a body is read: 429 (recorded and traced like any refusal) when the
        tenant's rate limits have nothing left (check_limits), or, for a large body
        (is_large), when its large bodies have spent its share of the loop's parse time. A
        refused body that may be large (its size declared so, or not declared) is not read:
        its connection is closed and the refusal held (_hold)."""
        started = time.monotonic()
        try:
            if check_limits:
                await self.admission.screen(principal)
            if is_large:
                self.admission.check_parse_time(principal)
        except AdmissionRefusal as refusal:
            trace = self.runtime.telemetry.start_request(
                GenAiRequest(operation=_operation(endpoint), request_model=None,
                             tier=principal.tier, tenant_id=str(principal.tenant_id)),
                start_s=arrival,
            )
            trace.admission_refused(refusal, started)
            record = refused_record(_response_id(endpoint), principal, endpoint, served, 0,
                                    arrival, refusal)
            trace.finished(_trace_response(record, served))
            await self.runtime.publish(record)
            if may_be_large:
                # The body is not read: closing the connection stops its bytes (up to
                # --max-body-bytes a request) at the socket instead of draining them.
                refusal.headers["connection"] = "close"
                await self._hold(refusal)
            raise

    async def _hold(self, refusal: AdmissionRefusal) -> None:
        """Wait out the refusal's retry delay (SCREEN_HOLD_MAX_S at most) before it is
        answered, unless MAX_HELD_REFUSALS are waiting already."""
        delay_s = min(refusal.retry_after_s or 0.0, SCREEN_HOLD_MAX_S)
        if delay_s <= 0 or self._num_held_refusals >= MAX_HELD_REFUSALS:
            return
        self._num_held_refusals += 1
        try:
            await asyncio.sleep(delay_s)
        finally:
            self._num_held_refusals -= 1

    def _encoder_threads(self) -> anyio.CapacityLimiter:
        """One worker thread tokenizes large prompts at a time, leaving the other cores to
        the engine and the event loop (created on first use, inside the running loop)."""
        if self._encoder_limiter is None:
            self._encoder_limiter = anyio.CapacityLimiter(1)
        return self._encoder_limiter


class _EventStream(StreamingResponse):
    """A request's event stream, whose client must keep reading: a chunk left unread for
    write_timeout_s (the socket's buffers full) ends the request as the client's leaving
    would (cancelled in the engine, recorded as aborted) and drops the connection, so a
    client that never reads holds no slot, memory or drain for longer than that."""

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        write_timeout_s: float,
        headers: Mapping[str, str],
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._write_timeout_s = write_timeout_s
        self._scope: Scope = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._scope = scope
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        async def send_in_time(message: Message) -> None:
            with anyio.fail_after(self._write_timeout_s):
                await send(message)

        try:
            await super().stream_response(send_in_time)
        except TimeoutError:
            logger.warning("a stream's client left a chunk unread for %.0f s: aborting it",
                           self._write_timeout_s)
            await self._events.aclose()  # the request ends (and is recorded) here
            # Reset, not closed: a close would wait for the unread buffers to drain.
            if not await abort_connection(self._scope):
                logger.warning("the server cannot reset a connection: it stays open until "
                               "its client reads or leaves")


class _Run:
    """One admitted generation request, from the first engine output to its record."""

    def __init__(
        self,
        api: _OpenAIApi,
        served: ServedModel,
        principal: TenantPrincipal,
        request: GenerationRequest,
        job: GenerationJob,
        grant: AdmissionGrant,
        arrival: float,
        trace: RequestTrace,
    ) -> None:
        self.api = api
        self.trace = trace
        self.served = served
        self.principal = principal
        self.request = request
        self.job = job
        self.grant = grant
        self.arrival = arrival
        self.created_at = datetime.now(UTC)
        self.context = ResponseContext(
            endpoint=request.endpoint,
            response_id=job.request_id,
            created=int(time.time()),
            model=served.name,
            include_usage=request.include_usage,
        )
        self.first_token_time: float | None = None
        # Per choice: arrival times of its outputs that carried tokens (TPOT).
        self._token_times: list[list[float]] = [[] for _ in range(job.num_choices)]
        self._finalized = False
        self._has_started = False
        # Tools offered: calls are read out of each choice's text (gateway.openai.tool_calls).
        self._tool_format = served.tool_format if request.tools.is_active else None
        self._tool_names = frozenset(tool.name for tool in request.tools.tools)

    # -- non-streamed ----------------------------------------------------------------------------

    async def respond(self, http_request: Request) -> Response:
        choices = [ChoiceText() for _ in range(self.job.num_choices)]
        if self.request.echo:
            for index, choice in enumerate(choices):
                choice.text = self._prompt_text(index)
        status, error = RequestEnd.ABORTED, None
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_cancel_on_disconnect, http_request, group.cancel_scope)
                async for index, output in self.job.outputs():
                    self._observe(index, output)
                    choice = choices[index]
                    choice.text += output.new_text
                    choice.logprobs.extend(output.logprobs)
                    if output.finished:
                        choice.finish_reason = output.finish_reason
                group.cancel_scope.cancel()
            status, error = self._outcome()
        except Exception as exc:  # the engine loop died
            status, error = RequestEnd.FAILED, f"{type(exc).__name__}"
        finally:
            with anyio.CancelScope(shield=True):
                await self.job.cancel()  # a disconnect: wait for the abort's metering
                if status is RequestEnd.ABORTED:
                    status, error = self._outcome()
                is_recorded = await self._finalize(status)
        if status is RequestEnd.ABORTED:
            return Response(status_code=499)  # nobody is listening
        if not is_recorded:
            raise _record_lost_error()
        if status is RequestEnd.FAILED:
            fault = self._request_fault()
            if fault is not None:  # what the request asked for cost more than it may
                raise BadRequestError(fault.error or "", param=self._constraint_param(),
                                      code=fault.error_code)
            logger.error("request %s failed in the engine: %s", self.job.request_id, error)
            raise InternalServerError(
                "the engine failed while generating this request", code="engine_error"
            )
        args = (self.context, choices, self.job.summary(), self.served.tokenizer,
                self._tool_format, self._tool_names)
        if self._tool_format is not None and sum(len(c.text) for c in choices) > (
                TOOL_PARSE_OFF_LOOP_CHARS):
            body = await anyio.to_thread.run_sync(full_response, *args)
        else:
            body = full_response(*args)
        return JSONResponse(body, headers=self.grant.headers)

    # -- streamed --------------------------------------------------------------------------------

    async def stream(self) -> AsyncGenerator[str, None]:
        status = RequestEnd.ABORTED
        started = [False] * self.job.num_choices
        offsets = [0] * self.job.num_choices
        tool_streams = (
            None if self._tool_format is None
            else [StreamedToolCalls(self._tool_format, self._tool_names)
                  for _ in range(self.job.num_choices)]
        )
        try:
            async for index, output in self.job.outputs():
                self._observe(index, output)
                text = output.new_text
                if not started[index] and self.request.echo:
                    text = self._prompt_text(index) + text
                if self.job.is_finished:
                    # The request's last output: its record is durable before the client
                    # sees the end, or the client sees an error instead of the end.
                    status, _ = self._outcome()
                    if not await self._finalize(status):
                        yield _sse(_record_lost_error().body())
                        return
                    if status is RequestEnd.FAILED:
                        fault = self._request_fault()
                        yield _sse(
                            error_body("the engine failed while generating this request",
                                       "server_error", code="engine_error")
                            if fault is None else
                            error_body(fault.error or "", "invalid_request_error",
                                       param=self._constraint_param(), code=fault.error_code)
                        )
                        return
                    if self.job.is_stopped_unread:
                        yield _sse(error_body(
                            f"this stream was stopped: its client left more than "
                            f"{MAX_UNREAD_OUTPUTS_PER_CHOICE} chunks a choice unread",
                            "invalid_request_error", code="stream_not_read",
                        ))
                        return
                if output.finished and output.finish_reason not in ("stop", "length"):
                    continue  # an error ends the stream above, not as a choice
                finish_reason = output.finish_reason if output.finished else None
                tool_calls = None
                if tool_streams is not None:
                    text = tool_streams[index].feed(text)
                    if output.finished:
                        streamed = tool_streams[index]
                        rest, calls = (
                            await anyio.to_thread.run_sync(streamed.finish)
                            if streamed.num_chars > TOOL_PARSE_OFF_LOOP_CHARS
                            else streamed.finish()
                        )
                        text += rest
                        if calls:
                            tool_calls = [call.as_openai(i) for i, call in enumerate(calls)]
                            finish_reason = "tool_calls" if finish_reason == "stop" else (
                                finish_reason)
                yield _choice_chunk(self, index, text, output, started, offsets,
                                    finish_reason, tool_calls)
            if self.request.include_usage:
                yield _sse(usage_chunk(self.context, self.job.summary()))
            yield "data: [DONE]\n\n"
        except Exception as exc:  # the engine loop died mid-stream
            logger.error("stream %s failed: %s", self.job.request_id, exc)
            status = RequestEnd.FAILED
            with anyio.CancelScope(shield=True):
                await self._finalize(status)
            yield _sse(error_body(
                "the engine failed while generating this request", "server_error",
                code="engine_error",
            ))
        finally:
            with anyio.CancelScope(shield=True):
                await self.job.cancel()
                await self._finalize(status)

    # -- shared ----------------------------------------------------------------------------------

    def _prompt_text(self, choice_index: int) -> str:
        prompt = self.job.prompts[choice_index // self.job.params.n]
        if prompt.text is not None:
            return prompt.text
        return self.served.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)

    def _observe(self, index: int, output: RequestOutput) -> None:
        if not self._has_started:  # the engine runs it: no longer queued (max_queued_requests)
            self._has_started = True
            self.api.admission.started(self.grant)
        if output.new_token_ids:
            now = time.monotonic()
            if self.first_token_time is None:
                self.first_token_time = now
                metrics = output.metrics
                if metrics is not None and metrics.first_scheduled_time is not None:
                    self.trace.scheduled(metrics.first_scheduled_time)
                self.trace.first_token(now)
            self._token_times[index].append(now)

    def _request_fault(self) -> ChoiceState | None:
        """The first choice that ended with an error the request itself caused (its grammar
        past its budget or limits), which its client gets as a bad request."""
        for choice in self.job.choices:
            if choice.finish_reason == "error" and (
                    choice.error_code in RequestErrorCode.CAUSED_BY_REQUEST):
                return choice
        return None

    def _constraint_param(self) -> str | None:
        structured = self.job.params.structured
        return None if structured is None else structured.param

    def _outcome(self) -> tuple[RequestEnd, str | None]:
        errors = [c.error for c in self.job.choices if c.finish_reason == "error"]
        if errors:
            return RequestEnd.FAILED, errors[0]
        if self.job.is_complete:
            return RequestEnd.COMPLETED, None
        return RequestEnd.ABORTED, None

    async def _finalize(self, status: RequestEnd) -> bool:
        """Once per request: publish the record, release admission, end in-flight. Shielded:
        a client that goes away meanwhile cannot skip the record. The release comes after
        the record, whose usage is then in the ledger's monthly totals: the budget it held
        is never counted by neither. False when the record could not be written (the client
        must then get an error, not the result)."""
        if self._finalized:
            return True
        self._finalized = True
        runtime = self.api.runtime
        is_recorded = False
        with anyio.CancelScope(shield=True):
            try:
                record = self._record(status)
                self.trace.finished(_trace_response(record, self.served))
                try:
                    await runtime.publish(record)
                    is_recorded = True
                except RecordLostError:
                    pass  # logged by publish
                summary = self.job.summary()
                await self.api.admission.release(
                    self.grant, summary.num_prompt_tokens + summary.num_completion_tokens
                )
            finally:
                runtime.request_ended()
        return is_recorded

    def _http_status(self, status: RequestEnd) -> int:
        if status is RequestEnd.ABORTED:
            return 499  # the client closed the connection before the end (nginx's convention)
        if status is RequestEnd.FAILED and not self.request.stream:
            # a stream that started stays 200; its error is an event
            return 400 if self._request_fault() is not None else 500
        return 200

    def _record(self, status: RequestEnd) -> RequestRecord:
        summary = self.job.summary()
        now = time.monotonic()
        metrics = [m for m in self.job.last_metrics if m is not None]
        reasons = {r for r in summary.finish_reasons if r is not None}
        finish_reason = (
            None if not reasons else "length" if reasons == {"length"}
            else "stop" if reasons <= {"stop", "length"} else sorted(reasons)[0]
        )
        gpu = sum(m.gpu_seconds for m in metrics)
        recompute = sum(m.recompute_gpu_seconds for m in metrics)
        charged = _most_charged_tenant(metrics)
        gaps = [
            (times[-1] - times[0]) / (len(times) - 1)
            for times in self._token_times
            if len(times) >= 2
        ]
        inter_token_gaps = tuple(
            later - earlier
            for times in self._token_times
            for earlier, later in itertools.pairwise(times)
        )
        queue_times = [m.queue_time_s for m in metrics if m.queue_time_s is not None]
        return RequestRecord(
            request_id=self.job.request_id,
            tenant_id=self.principal.tenant_id,
            api_key_id=self.principal.api_key_id,
            model=self.served.name,
            tier=self.principal.tier,
            endpoint=self.request.endpoint,
            status=status,
            finish_reason=finish_reason,
            num_prompt_tokens=summary.num_prompt_tokens,
            num_cached_prompt_tokens=summary.num_cached_prompt_tokens,
            num_completion_tokens=summary.num_completion_tokens,
            gpu_seconds=gpu,
            recompute_gpu_seconds=recompute,
            recompute_charged_tenant_id=int(charged) if charged else None,
            num_preemptions=summary.num_preemptions,
            queue_time_s=max(queue_times) if queue_times else None,
            ttft_s=None if self.first_token_time is None else self.first_token_time - self.arrival,
            e2e_time_s=now - self.arrival,
            tpot_s=sum(gaps) / len(gaps) if gaps else None,
            inter_token_gaps_s=inter_token_gaps,
            created_at=self.created_at,
            finished_at=datetime.now(UTC),
            http_status=self._http_status(status),
            grammar_compile_s=sum(m.grammar_compile_s for m in metrics),
        )


def _record_lost_error() -> ServiceUnavailableError:
    return ServiceUnavailableError(
        "the usage of this request could not be recorded, so its result is withheld; "
        "retry later",
        code="usage_not_recorded",
    )


def _operation(endpoint: Endpoint) -> str:
    """gen_ai.operation.name."""
    return "chat" if endpoint is Endpoint.CHAT else "text_completion"


def _response_id(endpoint: Endpoint) -> str:
    prefix = "chatcmpl" if endpoint is Endpoint.CHAT else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}"


def refused_record(
    request_id: str,
    principal: TenantPrincipal,
    endpoint: Endpoint,
    served: ServedModel,
    num_prompt_tokens: int,
    arrival: float,
    refusal: AdmissionRefusal,
) -> RequestRecord:
    now = datetime.now(UTC)
    return RequestRecord(
        request_id=request_id,
        tenant_id=principal.tenant_id,
        api_key_id=principal.api_key_id,
        model=served.name,
        tier=principal.tier,
        endpoint=endpoint,
        status=RequestEnd.REFUSED,
        finish_reason=None,
        num_prompt_tokens=num_prompt_tokens,
        num_cached_prompt_tokens=0,
        num_completion_tokens=0,
        gpu_seconds=0.0,
        recompute_gpu_seconds=0.0,
        recompute_charged_tenant_id=None,
        num_preemptions=0,
        queue_time_s=None,
        ttft_s=None,
        e2e_time_s=time.monotonic() - arrival,
        tpot_s=None,
        inter_token_gaps_s=(),
        created_at=now,
        finished_at=now,
        http_status=refusal.status_code,
        refusal_reason=refusal.reason,
    )


def _most_charged_tenant(metrics: list[RequestMetrics]) -> int | None:
    """The tenant charged the most recompute over the request's samples."""
    charges: dict[str, float] = {}
    for m in metrics:
        for tenant_id, seconds in m.recompute_gpu_seconds_by_tenant.items():
            charges[tenant_id] = charges.get(tenant_id, 0.0) + seconds
    if not charges:
        return None
    return int(max(charges, key=lambda tenant_id: charges[tenant_id]))


def _trace_response(record: RequestRecord, served: ServedModel) -> GenAiResponse:
    error_type = {
        RequestEnd.FAILED: "engine_error",
        RequestEnd.ABORTED: "client_disconnected",
        RequestEnd.REFUSED: record.refusal_reason or "refused",
    }.get(record.status)
    return GenAiResponse(
        response_id=record.request_id if record.status is not RequestEnd.REFUSED else None,
        response_model=served.name,
        finish_reasons=[record.finish_reason] if record.finish_reason else [],
        num_input_tokens=record.num_prompt_tokens,
        num_output_tokens=record.num_completion_tokens,
        num_cached_input_tokens=record.num_cached_prompt_tokens,
        error_type=error_type,
    )


def _choice_chunk(
    run: _Run,
    index: int,
    text: str,
    output: RequestOutput,
    started: list[bool],
    offsets: list[int],
    finish_reason: str | None,
    tool_calls: list[dict[str, Any]] | None,
) -> str:
    body = chunk(
        run.context,
        index,
        text=text,
        role=not started[index],
        logprobs=output.logprobs or None,
        finish_reason=finish_reason,
        text_offset=offsets[index],
        tokenizer=run.served.tokenizer,
        tool_calls=tool_calls,
    )
    started[index] = True
    offsets[index] += len(text)
    return _sse(body)


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    """Cancel scope when the client goes away (non-streamed requests)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def _check_tier_allows(request: GenerationRequest, tier: Tier) -> None:
    """400 for a raw grammar from a tier whose requests may not send one."""
    structured = request.structured
    if structured is not None and structured.kind == "grammar" and not tier.raw_grammars:
        raise BadRequestError(
            f"raw Lark and GBNF grammars are not available to the {tier.name} tier; use a "
            "JSON schema, a regex or a list of choices",
            param=structured.param, code="unsupported_parameter",
        )


def _model_card(served: ServedModel) -> dict[str, Any]:
    return {"id": served.name, "object": "model", "created": served.created, "owned_by": "tiergate"}


def _unknown_model(name: str) -> GatewayError:
    return NotFoundError(
        f"the model {name!r} does not exist on this server", param="model", code="model_not_found"
    )
