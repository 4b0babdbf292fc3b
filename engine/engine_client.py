"""EngineClient: what an asyncio caller holds of a running engine, wherever its loop runs.

Callers on an event loop submit requests and read each request's outputs from its own
asyncio.Queue; the engine's loop (a thread beside them, `engine.async_engine`, or a process
of its own, `engine.engine_process`) hands each step's outputs over with
loop.call_soon_threadsafe. This class owns that hand-over and the generate() iteration; its
subclasses say how a command (`engine.engine_loop`) reaches the engine's loop and where the
outputs come from.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.engine_loop import AbortRequest, AddRequest, EngineCommand, RecordRefused
from engine.errors import EngineDeadError, InvalidRequestError
from engine.llm_engine import TenantContext
from engine.outputs import RequestOutput
from engine.request_limits import RequestLimits
from engine.sampling_params import SamplingParams
from engine.scheduler_stats import SchedulerStats

_OutputQueue = asyncio.Queue[RequestOutput | BaseException]
# Outputs of one step for one event loop, each with its stream's queue.
_Batch = list[tuple[_OutputQueue, RequestOutput]]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: _OutputQueue
    num_samples: int  # finished outputs expected before the stream ends


class EngineClient(ABC):
    def __init__(self, limits: RequestLimits, stats: SchedulerStats) -> None:
        self.limits = limits
        self._stats = stats
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()

    # -- called from the event loop ------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        tenant: TenantContext | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of every sample of the request as they come; ends when all have finished.
        Leaving the iteration early (client gone) aborts the request."""
        tenant = tenant or TenantContext()
        # Validate here so bad input fails the caller, not the engine's loop.
        self.validate_request(prompt_token_ids, sampling_params, tenant)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), sampling_params.n)
        with self._streams_lock:
            if request_id in self._streams:  # its outputs would go to this stream
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        # Checked once registered: a loop that stops from here on fails this stream too.
        if not self.is_running:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            raise EngineDeadError("the engine loop is not running")
        self._send(AddRequest(request_id, prompt_token_ids, sampling_params, tenant))
        finished = 0
        try:
            while finished < stream.num_samples:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished += item.finished
                yield item
        finally:
            with self._streams_lock:
                still_open = self._streams.pop(request_id, None) is not None
            if still_open and finished < stream.num_samples:
                self.abort(request_id)

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, tenant: TenantContext
    ) -> int:
        """Check the request can ever run (`RequestLimits.validate`); returns its max_tokens."""
        return self.limits.validate(prompt_token_ids, params, tenant)

    def stats(self) -> SchedulerStats:
        """The snapshot taken after the latest step (safe to read from any thread)."""
        return self._stats

    def abort(self, request_id: str) -> None:
        """End the request's samples before the engine's next step."""
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

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams, before the step's statistics are taken.

        First tokens go out first (their consumers wake first on the event loop, ahead of a
        full batch's later tokens). One call into each event loop
        per step, not one per output: each call wakes the loop, a system call and, with the
        engine in a thread, a contest for the GIL, 64 times a step at a full batch."""
        batches: dict[asyncio.AbstractEventLoop, _Batch] = {}
        with self._streams_lock:
            for output in sorted(outputs, key=_is_not_first_token):
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        """End one request's stream with exc (raised to its caller)."""
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)

    def _fail_all(self) -> None:
        """The engine's loop has stopped: every open stream ends with EngineDeadError."""
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.loop.call_soon_threadsafe(
                stream.queue.put_nowait, EngineDeadError("the engine loop stopped")
            )


def _put_all(batch: _Batch) -> None:
    """On the event loop: each output into its stream's queue, in the step's order."""
    for queue, output in batch:
        queue.put_nowait(output)


def _is_not_first_token(output: RequestOutput) -> bool:
    """Sort key: a sample's first tokens before later ones (stable otherwise)."""
    return not output.new_token_ids or output.num_output_tokens > len(output.new_token_ids)
