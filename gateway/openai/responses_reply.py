"""An admitted Responses API request's reply: the response object, or the rendering of its
event stream, and the response kept in the store (when asked) before its client sees it
end."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine import RequestOutput
from gateway.http.errors import GatewayError
from gateway.openai.admitted_request import AdmittedRequest
from gateway.openai.generation import JobSummary
from gateway.openai.response_store import ResponseStore
from gateway.openai.responses_output import ResponseEvents, ResponseShell
from gateway.openai.tool_calls import ParsedCall


async def respond(run: AdmittedRequest, shell: ResponseShell, store: ResponseStore,
                  http_request: Request) -> Response:
    choices = await run.finished_choices(http_request)
    if choices is None:
        return Response(status_code=499)  # nobody is listening
    choice = choices[0]
    text, calls = choice.text, list[ParsedCall]()
    if run.tool_format is not None:
        parse = partial(run.tool_format.parse, choice.text, run.tool_names)
        text, calls = (await anyio.to_thread.run_sync(parse) if run.has_long_tool_text(choices)
                       else parse())
    shell.text, shell.logprobs = text, choice.logprobs
    shell.set_calls(calls)
    body = shell.body("completed", run.job.summary(), choice.finish_reason)
    if shell.is_stored:
        await store.save(run.principal.tenant_id, body, shell.conversation_messages())
    return JSONResponse(body, headers=run.grant.headers)


class ResponsesStream:
    """The Responses API's typed events of an admitted request (a StreamRendering): the
    response opened, its text as it comes, then the message closed, the calls, the response
    kept in the store (when asked), and response.completed (or an error event)."""

    def __init__(self, shell: ResponseShell, store: ResponseStore, tenant_id: int) -> None:
        self._shell = shell
        self._events = ResponseEvents(shell)
        self._store = store
        self._tenant_id = tenant_id
        self._finish_reason: str | None = None
        self._calls: list[ParsedCall] = []

    def opening(self) -> Sequence[str]:
        return self._events.start()

    def choice(self, index: int, text: str, output: RequestOutput, finish_reason: str | None,
               calls: list[ParsedCall]) -> Sequence[str]:
        if finish_reason is not None:
            self._finish_reason, self._calls = finish_reason, calls
        return self._events.text(text, output.logprobs)

    def failure(self, body: dict[str, Any]) -> str:
        return self._events.error(body)

    async def closing(self, summary: JobSummary) -> Sequence[str]:
        events = self._events.finish(self._calls)
        body = self._shell.body("completed", summary, self._finish_reason)
        if self._shell.is_stored:
            try:
                await self._store.save(self._tenant_id, body,
                                       self._shell.conversation_messages())
            except GatewayError as exc:
                return [*events, self._events.error(exc.body())]
        return [*events, self._events.done(body)]
