"""EngineClient: what an asyncio caller holds of a running engine, wherever its loop runs.

A caller submits requests, each with the `OutputStream` its outputs go to (one stream may
take several requests: a job's prompts) and the choice number its sample 0 has there. The
engine's loop (a thread beside the caller, `engine.process.async_engine`, or a process of its
own, `engine.process.engine_process`) hands each step's `StepOutputs` to `_deliver`, which
makes each row a `RequestOutput` (the one conversion on this side of the pipe) and puts it
in its stream, one call into each event loop per step. This class owns that hand-over; its
subclasses say how a command (`engine.process.engine_loop`) reaches the engine's loop.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from engine.core.request_limits import RequestLimits
from engine.core.scheduler_stats import SchedulerStats
from engine.errors import EngineDeadError, InvalidRequestError
from engine.process.engine_loop import AbortRequest, AddRequest, EngineCommand, RecordRefused
from engine.sampling_params import SamplingParams
from engine.step_outputs import StepOutputs
from engine.types import LoraRequest, RequestOutput, TenantContext

__all__ = ["EngineClient", "OutputStream"]


class OutputStream:
    """The outputs of one consumer's requests, as (choice, output), in arrival order; an
    exception in it ends the consumer's reading (the engine stopped, or refused the add).

    Lives on the consumer's event loop: `_deliver` puts items in from there. max_unread
    bounds what may wait unread: past it on_overflow is called once (the consumer stops its
    requests, so the engine does not generate for a reader that has stopped reading)."""

    def __init__(self, max_unread: int | None = None,
                 on_overflow: Callable[[], None] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self._items: deque[tuple[int, RequestOutput] | BaseException] = deque()
        self._ready = asyncio.Event()
        self._max_unread = max_unread
        self._on_overflow = on_overflow
        self.overflowed = False

    def put(self, item: tuple[int, RequestOutput] | BaseException) -> None:
        """On the stream's event loop."""
        self._items.append(item)
        self._ready.set()
        if (self._max_unread is not None and len(self._items) > self._max_unread
                and not self.overflowed):
            self.overflowed = True
            if self._on_overflow is not None:
                self._on_overflow()

    async def get(self) -> tuple[int, RequestOutput]:
        """The next output; raises what was put as an exception."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def get_nowait(self) -> tuple[int, RequestOutput] | None:
        """An output already here, or None (exceptions are dropped: the consumer has left)."""
        while self._items:
            item = self._items.popleft()
            if not isinstance(item, BaseException):
                return item
        return None


@dataclass
class _Route:
    """Where a submitted request's outputs go."""

    stream: OutputStream
    first_choice: int  # the choice number of its sample 0 in the stream
    num_open: int  # samples not finished yet


class EngineClient(ABC):
    def __init__(self, limits: RequestLimits, stats: SchedulerStats, weight_format: str) -> None:
        """limits and weight_format: the engine's, fixed once it is built; stats: its first
        snapshot."""
        self.limits = limits
        # The weights as the engine serves them, as a label (ModelRunner.weight_format_label).
        self.weight_format = weight_format
        self._stats = stats
        self._routes: dict[str, _Route] = {}
        self._routes_lock = threading.Lock()

    # -- called from the event loop ------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        tenant: TenantContext,
        stream: OutputStream,
        first_choice: int = 0,
        lora: LoraRequest | None = None,
    ) -> None:
        """Start a request already checked against `limits` (the caller's edge did that),
        on lora's adapter or the base model: sample i's outputs go to stream as choice
        first_choice + i, until every sample has finished. Raises InvalidRequestError for an
        id in use, EngineDeadError when the engine's loop does not run."""
        with self._routes_lock:
            if request_id in self._routes:  # its outputs would go to this stream
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._routes[request_id] = _Route(stream, first_choice, sampling_params.n)
        # Checked once registered: a loop that stops from here on fails this route too.
        if not self.is_running:
            self.release([request_id])
            raise EngineDeadError("the engine loop is not running")
        self._send(AddRequest(request_id, prompt_token_ids, sampling_params, tenant, lora))

    def release(self, request_ids: list[str]) -> None:
        """Stop routing the requests' outputs (their consumer has left); the ones still open
        are aborted."""
        with self._routes_lock:
            open_ids = [request_id for request_id in request_ids
                        if self._routes.pop(request_id, None) is not None]
        for request_id in open_ids:
            self.abort(request_id)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        tenant: TenantContext | None = None,
        lora: LoraRequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of every sample of one request as they come; ends when all have finished.
        Checks the request against `limits` first. Leaving the iteration early (client
        gone) aborts the request."""
        tenant = tenant or TenantContext()
        self.validate_request(prompt_token_ids, sampling_params, tenant)
        stream = OutputStream()
        self.submit(request_id, prompt_token_ids, sampling_params, tenant, stream, lora=lora)
        num_open = sampling_params.n
        try:
            while num_open:
                _, output = await stream.get()
                num_open -= output.finished
                yield output
        finally:
            if num_open:
                self.release([request_id])

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, tenant: TenantContext
    ) -> int:
        """Check the request can ever run (`RequestLimits.validate`); returns its max_tokens."""
        return self.limits.validate(prompt_token_ids, params, tenant)

    def stats(self) -> SchedulerStats:
        """The snapshot taken after the latest step (safe to read from any thread)."""
        return self._stats

    def abort(self, request_id: str) -> None:
        """End the request's samples before the engine's next step; their final outputs
        still come to the stream while it is routed."""
        self._send(AbortRequest(request_id))

    def record_refused(self, num_prompt_tokens: int, tenant: TenantContext) -> None:
        """A request refused for overload (`LLMEngine.record_refused`), applied between steps."""
        self._send(RecordRefused(num_prompt_tokens, tenant))

    @abstractmethod
    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine's loop; requests still open get no more outputs."""

    @property
    @abstractmethod
    def is_running(self) -> bool:
        """The engine's loop takes requests."""

    @abstractmethod
    def _send(self, command: EngineCommand) -> None:
        """Hand the command to the engine's loop (`EngineLoop.submit`, here or in the
        engine's process)."""

    # -- called from the thread that receives the engine's outputs -----------------------------

    def _deliver(self, outputs: StepOutputs) -> None:
        """Hand a step's outputs to their streams, before the step's statistics are taken.

        First tokens go out first (their consumers wake first on the event loop, ahead of a
        full batch's later tokens). One call into each event loop per step, not one per
        output: each call wakes the loop, a system call and, with the engine in a thread, a
        contest for the GIL."""
        starts = outputs.token_starts()
        num_rows = len(outputs)
        firsts: list[int] = []
        laters: list[int] = []
        for row in range(num_rows):
            (firsts if outputs.is_first_token(row) else laters).append(row)
        rows: Sequence[int] = firsts + laters if firsts and laters else range(num_rows)
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, int, RequestOutput]]]
        batches = {}
        routes = self._routes
        ends = outputs.ends
        with self._routes_lock:
            for row in rows:
                request_id = outputs.request_ids[row]
                route = routes.get(request_id)
                if route is None:
                    continue
                if row in ends:
                    route.num_open -= 1
                    if route.num_open == 0:
                        del routes[request_id]
                batch = batches.get(route.stream.loop)
                if batch is None:
                    batch = batches[route.stream.loop] = []
                batch.append((route.stream, route.first_choice + outputs.sample_indices[row],
                              outputs.output(row, starts[row])))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        """End one request with exc (raised to its stream's reader)."""
        with self._routes_lock:
            route = self._routes.pop(request_id, None)
        if route is not None:
            route.stream.loop.call_soon_threadsafe(route.stream.put, exc)

    def _fail_all(self) -> None:
        """The engine's loop has stopped: every open stream ends with EngineDeadError."""
        with self._routes_lock:
            routes, self._routes = list(self._routes.values()), {}
        for route in routes:
            route.stream.loop.call_soon_threadsafe(
                route.stream.put, EngineDeadError("the engine loop stopped")
            )


def _put_all(batch: list[tuple[OutputStream, int, RequestOutput]]) -> None:
    """On the event loop: each output into its stream, in the step's order."""
    for stream, choice, output in batch:
        stream.put((choice, output))
