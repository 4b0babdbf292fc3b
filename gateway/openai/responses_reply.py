"""An admitted Responses API request's reply: the response object, or its event stream, and
the response kept in the store (when asked) before its client sees it end."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from functools import partial

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.http.errors import GatewayError
from gateway.openai.admitted_request import AdmittedRequest, StreamFailure
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


async def stream(run: AdmittedRequest, shell: ResponseShell,
                 store: ResponseStore) -> AsyncGenerator[str, None]:
    events = ResponseEvents(shell)
    for event in events.start():
        yield event
    finish_reason: str | None = None
    calls: list[ParsedCall] = []
    async with aclosing(run.stream_items()) as items:
        async for item in items:
            if isinstance(item, StreamFailure):
                yield events.error(item.body)
                return
            for event in events.text(item.text, item.output.logprobs):
                yield event
            if item.finish_reason is not None:
                finish_reason, calls = item.finish_reason, item.calls
    for event in events.finish(calls):
        yield event
    body = shell.body("completed", run.job.summary(), finish_reason)
    if shell.is_stored:
        try:
            await store.save(run.principal.tenant_id, body, shell.conversation_messages())
        except GatewayError as exc:
            yield events.error(exc.body())
            return
    yield events.done(body)
