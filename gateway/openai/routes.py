"""POST /v1/chat/completions, POST /v1/completions, the Responses API (POST /v1/responses,
GET and DELETE /v1/responses/{id}) and GET /v1/models.

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

Here: the routes, the screen and the order above. The body is read and parsed by
gateway.openai.body, an admitted request runs in gateway.openai.admitted_request, and every
request's record, refused or run, is built by gateway.openai.record_builder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import Message

from gateway.access.admission import AdmissionRefusal, GatewayAdmission
from gateway.access.auth import TenantPrincipal
from gateway.access.refusal_hold import RefusalHold
from gateway.http.errors import (
    BadRequestError,
    GatewayError,
    NotFoundError,
    PermissionDeniedError,
)
from gateway.http.event_stream import SSE_HEADERS, EventStream
from gateway.http.json_body import declared_length
from gateway.observability.telemetry import GenAiRequest, RequestTrace
from gateway.openai import responses_reply
from gateway.openai.admitted_request import AdmittedRequest
from gateway.openai.body import LARGE_BODY_BYTES, parse_body, read_body
from gateway.openai.generation import (
    STRUCTURED_OUTPUT_RESAMPLES,
    GenerationJob,
    JobSummary,
    check_constraints,
    check_fits,
    prepare_prompts,
    sampling_params,
)
from gateway.openai.record_builder import build_record, trace_response
from gateway.openai.request_record import RequestEnd
from gateway.openai.requests import Endpoint, GenerationRequest, RequestBounds
from gateway.openai.response_store import ResponseStore
from gateway.openai.responses_output import ResponseShell, new_response_id
from gateway.openai.responses_request import ResponsesCall
from gateway.server.runtime import GatewayRuntime
from gateway.server.served_model import ServedModel, tenant_context
from policies import AbovePlan, RefusalReason, ServiceTierError, Tier, served_tier


def openai_routes(api: OpenAIApi) -> list[BaseRoute]:
    return [
        Route("/v1/models", api.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.get_model, methods=["GET"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", api.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", api.delete_response, methods=["DELETE"]),
    ]


class OpenAIApi:
    def __init__(self, runtime: GatewayRuntime, admission: GatewayAdmission) -> None:
        self.runtime = runtime
        self.admission = admission
        self._encoder_limiter: anyio.CapacityLimiter | None = None
        self._refusal_hold = RefusalHold()
        settings = runtime.settings
        self._bounds = RequestBounds(settings.max_messages, settings.max_choices)
        self._responses = ResponseStore(runtime.session_factory,
                                        settings.response_retention_days)

    async def list_models(self, request: Request) -> Response:
        """The served models this tenant may use, and its adapters of them."""
        self.runtime.check_accepting()
        principal = await self.runtime.key_resolver.authenticate(request)
        models = self.runtime.loaded_models(principal)
        adapters = await self.runtime.adapters.visible(principal.tenant_id, list(models))
        return JSONResponse({"object": "list",
                             "data": [*map(_model_card, models.values()), *adapters]})

    async def get_model(self, request: Request) -> Response:
        self.runtime.check_accepting()
        principal = await self.runtime.key_resolver.authenticate(request)
        models = self.runtime.loaded_models(principal)
        name = request.path_params["model"]
        if name in models:
            return JSONResponse(_model_card(models[name]))
        target = await self.runtime.adapters.resolve(name, principal.tenant_id, list(models))
        if target is None:
            raise _unknown_model(name)
        cards = await self.runtime.adapters.visible(principal.tenant_id, list(models))
        card = next((c for c in cards if c["id"] == target.name), None)
        if card is None:  # unregistered since the lookup
            raise _unknown_model(name)
        return JSONResponse(card)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, Endpoint.CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def responses(self, request: Request) -> Response:
        return await self._generate(request, Endpoint.RESPONSES)

    async def get_response(self, request: Request) -> Response:
        """A stored response of the caller's tenant; any other id is the same 404."""
        self.runtime.check_accepting()
        principal = await self.runtime.key_resolver.authenticate(request)
        response_id = request.path_params["response_id"]
        row = await self._responses.find(principal.tenant_id, response_id)
        if row is None:
            raise _unknown_response(response_id)
        return JSONResponse(row.body)

    async def delete_response(self, request: Request) -> Response:
        self.runtime.check_accepting()
        principal = await self.runtime.key_resolver.authenticate(request)
        response_id = request.path_params["response_id"]
        if not await self._responses.delete(principal.tenant_id, response_id):
            raise _unknown_response(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def run_batch_line(self, principal: TenantPrincipal, endpoint: Endpoint,
                             body: bytes, request_id: str) -> tuple[int, dict[str, Any]]:
        """One line of a batch, run as the request it holds would be for principal (whose
        tier is the batch's): its status and body. request_id is the line's own, the same on
        every replica, so a line run twice is recorded once (the ledger keeps the first
        record of an id). Raises AdmissionRefusal when admission says no."""
        try:
            response = await self._generate(_batch_line_request(endpoint, body), endpoint,
                                            as_principal=principal, response_id=request_id)
        except AdmissionRefusal:
            raise
        except GatewayError as error:
            return error.status_code, error.body()
        return response.status_code, json.loads(bytes(response.body))

    async def _generate(self, http_request: Request, endpoint: Endpoint, *,
                        as_principal: TenantPrincipal | None = None,
                        response_id: str | None = None) -> Response:
        """as_principal: the one it runs as, when the caller is not authenticated by the
        request (a batch line); response_id: its id (else a new one)."""
        arrival = time.monotonic()
        self.runtime.check_accepting()
        principal = as_principal or await self.runtime.key_resolver.authenticate(http_request)
        settings = self.runtime.settings
        num_prompt_tokens = 0  # what a refused request is found to hold, charged to it
        declared = declared_length(http_request)
        # Before any of the body is read: a tenant out of requests or tokens, or (for a large
        # body) out of its share of the loop's parse time, is refused without costing more.
        await self._screen(principal, endpoint, arrival,
                           is_large=declared is not None and declared > LARGE_BODY_BYTES,
                           may_be_large=declared is None or declared > LARGE_BODY_BYTES)
        try:
            raw = await read_body(
                http_request,
                settings.max_body_bytes,
                on_large=None if declared is not None else lambda: self._screen(
                    principal, endpoint, arrival, is_large=True, may_be_large=True,
                    check_limits=False),
            )
            body_bytes = len(raw)
            started = time.perf_counter()
            try:
                parsed_body = parse_body(raw, endpoint, self._bounds)
            finally:
                if body_bytes > LARGE_BODY_BYTES:
                    self.admission.spend_parse_time(principal, time.perf_counter() - started)
            del raw
            call = None  # the Responses API's request, around the chat request it runs as
            if isinstance(parsed_body, ResponsesCall):
                call = await self._continued(parsed_body, principal)
                parsed = call.request
            else:
                parsed = parsed_body
            # The tier it runs in, is billed at and reports: the tenant's own, or the one its
            # service_tier asks for where the plan allows it.
            principal = self._in_served_tier(principal, parsed)
            # A served model this tenant may use, or an adapter of one; any other name is
            # the same 404, whether or not it exists for another tenant.
            target = await self.runtime.adapters.resolve(
                parsed.model, principal.tenant_id, self.runtime.allowed_models(principal))
            if target is None:
                raise _unknown_model(parsed.model)
            served, engine = self.runtime.ready_model(target.base)
            _check_tier_allows(parsed, self.runtime.tiers[principal.tier])
            # A small body's prompts are tokenized on the event loop: the hand-over to a thread
            # cost a request up to 16 ms before admission under 2x load on the CPU benchmark.
            # A large body's go to a thread whose encoder releases the GIL (1 MiB of text: about
            # a second of encoding, during which the loop serves every other tenant).
            off_loop = self._encoder_threads() if body_bytes > LARGE_BODY_BYTES else None
            prompts = await prepare_prompts(parsed, served, off_loop)
            num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
            params = sampling_params(parsed, served)
            check = await check_constraints(parsed, params, served, principal.cache_salt)
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
        response_id = response_id or _response_id(endpoint)
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
                    model=served.name,
                    num_prompt_tokens=num_prompt_tokens,
                    num_max_tokens=params.n * sum(max_tokens),
                )
        except AdmissionRefusal as refusal:
            if refusal.reason == RefusalReason.SHED:  # demand all the same (policies.tenant_demand)
                for prompt in prompts:
                    engine.record_refused(len(prompt.token_ids), tenant)
            await self._publish_refusal(
                trace, response_id, principal, endpoint, served.name, num_prompt_tokens,
                arrival, refusal, target.adapter,
            )
            raise
        trace.queued()
        job = GenerationJob(engine, response_id, prompts, params, tenant, served.tokenizer,
                            target.lora, check,
                            resamples=0 if parsed.stream else STRUCTURED_OUTPUT_RESAMPLES)
        run = AdmittedRequest(
            self.runtime, self.admission, served, principal, parsed, job, grant, arrival, trace,
            target,
        )
        self.runtime.request_started()
        self.runtime.adapters.started(target)
        if call is not None:
            shell = ResponseShell(
                call, response_id, target.name, run.context.service_tier, served.tokenizer,
                is_stored=call.store and self._responses.keeps_responses)
            if parsed.stream:
                rendering = responses_reply.ResponsesStream(shell, self._responses,
                                                            principal.tenant_id)
                return EventStream(run.stream(rendering),
                                   settings.stream_write_timeout_s,
                                   headers={**SSE_HEADERS, **grant.headers})
            return await responses_reply.respond(run, shell, self._responses, http_request)
        if parsed.stream:
            return EventStream(
                run.stream(), settings.stream_write_timeout_s,
                headers={**SSE_HEADERS, **grant.headers},
            )
        return await run.respond(http_request)

    async def _continued(self, call: ResponsesCall, principal: TenantPrincipal
                         ) -> ResponsesCall:
        """The call after the stored conversation of its previous_response_id (the
        tenant's own, within its retention; any other id is a 400)."""
        if call.previous_response_id is None:
            return call
        row = await self._responses.find(principal.tenant_id, call.previous_response_id)
        if row is None:
            raise BadRequestError(
                f"previous response {call.previous_response_id!r} not found (it may have "
                "been deleted, expired, or never stored)",
                param="previous_response_id", code="previous_response_not_found")
        return call.continued(row.conversation, self._bounds)

    def _in_served_tier(self, principal: TenantPrincipal,
                        parsed: GenerationRequest) -> TenantPrincipal:
        """The principal as the request runs: its tier the one its service_tier gets."""
        try:
            tier = served_tier(self.runtime.tiers, principal.tier, parsed.service_tier,
                               AbovePlan(self.runtime.settings.service_tier_above_plan))
        except ServiceTierError as exc:
            if exc.is_permission:
                raise PermissionDeniedError(str(exc), param="service_tier",
                                            code="service_tier_not_allowed") from None
            raise BadRequestError(str(exc), param="service_tier") from None
        return principal if tier.name == principal.tier else dataclasses.replace(
            principal, tier=tier.name)

    async def _screen(
        self, principal: TenantPrincipal, endpoint: Endpoint, arrival: float, *,
        is_large: bool, may_be_large: bool, check_limits: bool = True,
    ) -> None:
        """Before a body is read: 429 (recorded and traced like any refusal) when the
        tenant's rate limits have nothing left (check_limits), or, for a large body
        (is_large), when its large bodies have spent its share of the loop's parse time. A
        refused body that may be large (its size declared so, or not declared) is not read:
        its connection is closed and the refusal held (gateway.access.refusal_hold)."""
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
            # Its body unread, it names no model (but the only one a replica serves).
            await self._publish_refusal(
                trace, _response_id(endpoint), principal, endpoint,
                self.runtime.sole_model_name, 0, arrival, refusal,
            )
            if may_be_large:
                # The body is not read: closing the connection stops its bytes (up to
                # --max-body-bytes a request) at the socket instead of draining them.
                refusal.headers["connection"] = "close"
                await self._refusal_hold.wait(refusal)
            raise

    async def _publish_refusal(
        self, trace: RequestTrace, response_id: str, principal: TenantPrincipal,
        endpoint: Endpoint, model: str, num_prompt_tokens: int, arrival: float,
        refusal: AdmissionRefusal, adapter: str | None = None,
    ) -> None:
        """The refused request's record, to its trace and the runtime: counted, not written
        (no wait on the ledger). adapter: the one it asked for, once its body was read."""
        record = build_record(
            response_id, principal, model, endpoint, RequestEnd.REFUSED,
            JobSummary(num_prompt_tokens, num_cached_prompt_tokens=0, num_completion_tokens=0),
            arrival=arrival, http_status=refusal.status_code, refusal_reason=refusal.reason,
            adapter=adapter,
        )
        trace.finished(trace_response(record, model))
        await self.runtime.publish(record)

    def _encoder_threads(self) -> anyio.CapacityLimiter:
        """One worker thread tokenizes large prompts at a time, leaving the other cores to
        the engine and the event loop (created on first use, inside the running loop)."""
        if self._encoder_limiter is None:
            self._encoder_limiter = anyio.CapacityLimiter(1)
        return self._encoder_limiter


def _operation(endpoint: Endpoint) -> str:
    """gen_ai.operation.name."""
    return "chat" if endpoint.is_chat else "text_completion"


def _response_id(endpoint: Endpoint) -> str:
    if endpoint is Endpoint.RESPONSES:
        return new_response_id()
    prefix = "chatcmpl" if endpoint is Endpoint.CHAT else "cmpl"
    return f"{prefix}-{secrets.token_hex(16)}"


def _batch_line_request(endpoint: Endpoint, body: bytes) -> Request:
    """A request holding body, as a batch line's run reads it: once the body is read, its
    client never leaves."""
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # never a disconnect
        raise AssertionError("unreachable")

    scope = {"type": "http", "method": "POST", "path": f"/v1/{endpoint.value.replace('.', '/')}",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "query_string": b"", "client": None}
    return Request(scope, receive)


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


def _unknown_response(response_id: str) -> GatewayError:
    return NotFoundError(f"no response with id {response_id!r} is stored for this key's "
                         "tenant", param="response_id", code="response_not_found")


def _unknown_model(name: str) -> GatewayError:
    return NotFoundError(
        f"the model {name!r} does not exist on this server", param="model", code="model_not_found"
    )
