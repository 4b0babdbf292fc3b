"""One admitted generation request, from the engine's first output to its record: the
response (a JSON body, or an event stream whose last event waits for the record), what the
client's leaving or the engine's failing ends it as, and its finalization (the record
published before admission is released).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import RequestErrorCode, RequestOutput
from gateway.access.admission import AdmissionGrant, GatewayAdmission
from gateway.access.auth import TenantPrincipal
from gateway.adapters import ModelTarget
from gateway.http.errors import (
    BadRequestError,
    InternalServerError,
    ServiceUnavailableError,
    error_body,
)
from gateway.http.event_stream import sse_data
from gateway.observability.telemetry import RequestTrace
from gateway.openai.generation import (
    MAX_UNREAD_OUTPUTS_PER_CHOICE,
    ChoiceState,
    GenerationJob,
    JobSummary,
)
from gateway.openai.record_builder import build_record, trace_response
from gateway.openai.request_record import RequestEnd, RequestRecord
from gateway.openai.requests import GenerationRequest
from gateway.openai.responses import ChoiceText, ResponseContext, chunk, full_response, usage_chunk
from gateway.openai.tool_calls import ParsedCall, StreamedToolCalls
from gateway.server.runtime import GatewayRuntime, RecordLostError
from gateway.server.served_model import ServedModel

__all__ = ["AdmittedRequest", "StreamRendering"]

logger = logging.getLogger(__name__)

# Tool calls are read out of a reply this long (in characters) in a worker thread: the
# parse is linear, but a long reply's JSON is still milliseconds of work.
TOOL_PARSE_OFF_LOOP_CHARS = 64 << 10


class StreamRendering(Protocol):
    """How a stream's events are written: chat or completions chunks (_ChatChunks), or the
    Responses API's typed events (gateway.openai.responses_reply)."""

    def opening(self) -> Sequence[str]:
        """Events before the first output."""

    def choice(self, index: int, text: str, output: RequestOutput, finish_reason: str | None,
               calls: list[ParsedCall]) -> Sequence[str]:
        """What one output adds to its choice: text, and at the choice's end (finish_reason
        set, "tool_calls" when it called tools) the calls."""

    def failure(self, body: dict[str, Any]) -> str:
        """The last event of a stream that failed: its error body."""

    async def closing(self, summary: JobSummary) -> Sequence[str]:
        """The last events of a stream whose choices all ended."""


class AdmittedRequest:
    """One admitted generation request, from the first engine output to its record."""

    def __init__(
        self,
        runtime: GatewayRuntime,
        admission: GatewayAdmission,
        served: ServedModel,
        principal: TenantPrincipal,
        request: GenerationRequest,
        job: GenerationJob,
        grant: AdmissionGrant,
        arrival: float,
        trace: RequestTrace,
        target: ModelTarget,
    ) -> None:
        """target: what it runs on (the served model, or an adapter of it); counted as
        running on it until its record is published."""
        self.runtime = runtime
        self.admission = admission
        self.trace = trace
        self.served = served
        self.target = target
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
            model=target.name,
            include_usage=request.include_usage,
            service_tier=runtime.tiers[principal.tier].service_tier,
        )
        self.first_token_time: float | None = None
        # Per choice: arrival times of its outputs that carried tokens (TPOT).
        self._token_times: list[list[float]] = [[] for _ in range(job.num_choices)]
        self._finalized = False
        self._has_started = False
        # Tools offered: calls are read out of each choice's text (gateway.openai.tool_calls).
        self.tool_format = served.tool_format if request.tools.is_active else None
        self.tool_names = frozenset(tool.name for tool in request.tools.tools)

    # -- non-streamed ----------------------------------------------------------------------------

    async def respond(self, http_request: Request) -> Response:
        """The chat or completions body of the finished request."""
        choices = await self.finished_choices(http_request)
        if choices is None:
            return Response(status_code=499)  # nobody is listening
        args = (self.context, choices, self.job.summary(), self.served.tokenizer,
                self.tool_format, self.tool_names)
        if self.has_long_tool_text(choices):
            body = await anyio.to_thread.run_sync(full_response, *args)
        else:
            body = full_response(*args)
        return JSONResponse(body, headers=self.grant.headers)

    def has_long_tool_text(self, choices: list[ChoiceText]) -> bool:
        """Whether tool calls are read out of so much text that the parse belongs in a
        worker thread."""
        return self.tool_format is not None and sum(len(c.text) for c in choices) > (
            TOOL_PARSE_OFF_LOOP_CHARS)

    async def finished_choices(self, http_request: Request) -> list[ChoiceText] | None:
        """Every choice's whole text once the request has ended and its record is written;
        None when the client left first. Raises the error the client gets when it failed or
        its record was lost."""
        choices = [ChoiceText() for _ in range(self.job.num_choices)]
        if self.request.echo:
            for index, choice in enumerate(choices):
                choice.text = self._prompt_text(index)
        status, error = RequestEnd.ABORTED, None
        watch = _DisconnectWatch(http_request)
        try:
            async for index, output in self.job.outputs():
                self._observe(index, output)
                choice = choices[index]
                if self.job.pop_resampled(index):  # its reply failed its schema: sampled anew
                    choice.text = self._prompt_text(index) if self.request.echo else ""
                    choice.logprobs.clear()
                choice.text += output.new_text
                choice.logprobs.extend(output.logprobs)
                if output.finished:
                    choice.finish_reason = output.finish_reason
            status, error = self._outcome()
        except asyncio.CancelledError:
            if not watch.client_left:
                raise
            watch.forgive()  # the client left: this request ends as aborted
        except Exception as exc:  # the engine loop died
            status, error = RequestEnd.FAILED, f"{type(exc).__name__}"
        finally:
            watch.stop()
            with anyio.CancelScope(shield=True):
                await self.job.cancel()  # a disconnect: wait for the abort's metering
                if status is RequestEnd.ABORTED:
                    status, error = self._outcome()
                is_recorded = await self._finalize(status)
        if status is RequestEnd.ABORTED:
            return None
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
        return choices

    # -- streamed --------------------------------------------------------------------------------

    async def stream(self, rendering: StreamRendering | None = None
                     ) -> AsyncGenerator[str, None]:
        """The request's event stream, written by rendering (default: chat or completions
        chunks): text that cannot be part of a tool call at once, the calls at the choice's
        end. The record of a request that ends is written before its last event (a client
        that saw the end is billed); a request that failed, or whose record was lost, ends
        with rendering.failure instead."""
        rendering = rendering or _ChatChunks(self)
        for event in rendering.opening():
            yield event
        status = RequestEnd.ABORTED
        started = [False] * self.job.num_choices
        tool_streams = (
            None if self.tool_format is None
            else [StreamedToolCalls(self.tool_format, self.tool_names)
                  for _ in range(self.job.num_choices)]
        )
        try:
            async for index, output in self.job.outputs():
                self._observe(index, output)
                text = output.new_text
                if not started[index] and self.request.echo:
                    text = self._prompt_text(index) + text
                started[index] = True
                if self.job.is_finished:
                    # The request's last output: its record is durable before the client
                    # sees the end, or the client sees an error instead of the end.
                    status, _ = self._outcome()
                    if not await self._finalize(status):
                        yield rendering.failure(_record_lost_error().body())
                        return
                    if status is RequestEnd.FAILED:
                        fault = self._request_fault()
                        yield rendering.failure(
                            error_body("the engine failed while generating this request",
                                       "server_error", code="engine_error")
                            if fault is None else
                            error_body(fault.error or "", "invalid_request_error",
                                       param=self._constraint_param(), code=fault.error_code)
                        )
                        return
                    if self.job.is_stopped_unread:
                        yield rendering.failure(error_body(
                            f"this stream was stopped: its client left more than "
                            f"{MAX_UNREAD_OUTPUTS_PER_CHOICE} chunks a choice unread",
                            "invalid_request_error", code="stream_not_read",
                        ))
                        return
                if output.finished and output.finish_reason not in ("stop", "length"):
                    continue  # an error ends the stream above, not as a choice
                finish_reason = output.finish_reason if output.finished else None
                calls: list[ParsedCall] = []
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
                        if calls and finish_reason == "stop":
                            finish_reason = "tool_calls"
                for event in rendering.choice(index, text, output, finish_reason, calls):
                    yield event
            for event in await rendering.closing(self.job.summary()):
                yield event
        except Exception as exc:  # the engine loop died mid-stream
            logger.error("stream %s failed: %s", self.job.request_id, exc)
            status = RequestEnd.FAILED
            with anyio.CancelScope(shield=True):
                await self._finalize(status)
            yield rendering.failure(error_body(
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
            self.admission.started(self.grant)
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
        is_recorded = False
        with anyio.CancelScope(shield=True):
            try:
                record = self._record(status)
                self.trace.finished(trace_response(record, self.target.name))
                try:
                    await self.runtime.publish(record)
                    is_recorded = True
                except RecordLostError:
                    pass  # logged by publish
                summary = self.job.summary()
                await self.admission.release(
                    self.grant, summary.num_prompt_tokens + summary.num_completion_tokens
                )
            finally:
                self.runtime.adapters.ended(self.target)
                self.runtime.request_ended()
        return is_recorded

    def _http_status(self, status: RequestEnd) -> int:
        if status is RequestEnd.ABORTED:
            return 499  # the client closed the connection before the end (nginx's convention)
        if status is RequestEnd.FAILED and not self.request.stream:
            # a stream that started stays 200; its error is an event
            return 400 if self._request_fault() is not None else 500
        return 200

    def _record(self, status: RequestEnd) -> RequestRecord:
        return build_record(
            self.job.request_id,
            self.principal,
            self.served.name,
            self.request.endpoint,
            status,
            self.job.summary(),
            arrival=self.arrival,
            http_status=self._http_status(status),
            created_at=self.created_at,
            metrics=self.job.all_metrics(),
            token_times=self._token_times,
            first_token_time=self.first_token_time,
            adapter=self.target.adapter,
            weight_format=self.served.weight_format,
        )


def _record_lost_error() -> ServiceUnavailableError:
    return ServiceUnavailableError(
        "the usage of this request could not be recorded, so its result is withheld; "
        "retry later",
        code="usage_not_recorded",
    )


class _DisconnectWatch:
    """Cancels the current task when its client goes away (a non-streamed request).

    The watch starts only once the request has run for WATCH_AFTER_S: most requests end
    sooner, and for them a timer costs far less than a task reading the connection (a
    disconnect before the watch starts is still read then, from the connection's queue)."""

    WATCH_AFTER_S = 0.05

    def __init__(self, request: Request) -> None:
        self._request = request
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._reader: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            self.WATCH_AFTER_S, self._start)
        self.client_left = False

    def _start(self) -> None:
        self._timer = None
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            message = await self._request.receive()
            if message["type"] == "http.disconnect":
                self.client_left = True
                self._task.cancel()
                return

    def forgive(self) -> None:
        """The cancellation it caused has been handled: the task goes on, uncancelled."""
        self._task.uncancel()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()


class _ChatChunks:
    """A chat or completions stream: a chunk per output, then usage (when asked) and
    [DONE]."""

    def __init__(self, run: AdmittedRequest) -> None:
        self._run = run
        self._started = [False] * run.job.num_choices
        self._offsets = [0] * run.job.num_choices

    def opening(self) -> Sequence[str]:
        return ()

    def choice(self, index: int, text: str, output: RequestOutput, finish_reason: str | None,
               calls: list[ParsedCall]) -> Sequence[str]:
        run = self._run
        body = chunk(
            run.context,
            index,
            text=text,
            role=not self._started[index],
            logprobs=output.logprobs or None,
            finish_reason=finish_reason,
            text_offset=self._offsets[index],
            tokenizer=run.served.tokenizer,
            tool_calls=[call.as_openai(i) for i, call in enumerate(calls)] or None,
        )
        self._started[index] = True
        self._offsets[index] += len(text)
        return (sse_data(body),)

    def failure(self, body: dict[str, Any]) -> str:
        return sse_data(body)

    async def closing(self, summary: JobSummary) -> Sequence[str]:
        if self._run.request.include_usage:
            return (sse_data(usage_chunk(self._run.context, summary)), "data: [DONE]\n\n")
        return ("data: [DONE]\n\n",)
