"""AsyncLLMEngine: the engine loop in its own thread, outputs delivered to asyncio consumers.

Callers on the event loop never touch the LLMEngine directly: add and abort are commands the
loop thread applies between steps, and each request's outputs arrive on its own asyncio.Queue
through loop.call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.errors import EngineDeadError, EngineError
from engine.llm_engine import LLMEngine, TenantContext
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler_stats import SchedulerStats

logger = logging.getLogger(__name__)


_OutputQueue = asyncio.Queue[RequestOutput | BaseException]
# Outputs of one step for one event loop, each with its stream's queue.
_Batch = list[tuple[_OutputQueue, RequestOutput]]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: _OutputQueue
    num_samples: int  # finished outputs expected before the stream ends


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: list[Callable[[], None]] = []
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._error: BaseException | None = None
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="tiergate-engine", daemon=True)
        self._thread.start()

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
        if self._error is not None or self._stopped:
            raise EngineDeadError("the engine loop is not running")
        # Validate here so bad input fails the caller, not the engine thread.
        self.engine.validate_request(prompt_token_ids, sampling_params, tenant or TenantContext())
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), sampling_params.n)
        with self._lock:
            self._streams[request_id] = stream

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt_token_ids, sampling_params, tenant)
            except EngineError as exc:  # e.g. a duplicate id: fail this caller only
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)

        self._submit(add)
        finished = 0
        try:
            while finished < stream.num_samples:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished += item.finished
                yield item
        finally:
            with self._lock:
                still_open = self._streams.pop(request_id, None) is not None
            if still_open and finished < stream.num_samples:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self.engine.abort(request_id))

    def record_refused(self, num_prompt_tokens: int, tenant: TenantContext) -> None:
        """A request refused for overload (`LLMEngine.record_refused`), applied between steps."""
        self._submit(lambda: self.engine.record_refused(num_prompt_tokens, tenant))

    def stats(self) -> SchedulerStats:
        """The snapshot taken after the latest step (safe to read from any thread)."""
        return self._stats

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def _submit(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._commands.append(command)
        self._wake.set()

    # -- the loop thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped:
                with self._lock:
                    commands, self._commands = self._commands, []
                    taken_in_at_s = time.monotonic()  # what is submitted later is not in
                for command in commands:
                    command()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                # First tokens go out first (their consumers wake first on the event loop,
                # ahead of a full batch's later tokens), and before the statistics snapshot.
                self._deliver(sorted(self.engine.step(), key=_is_not_first_token))
                stats = self.engine.stats()
                stats.taken_in_at_s = taken_in_at_s
                self._stats = stats
        except BaseException as exc:  # the loop itself broke: fail every open stream
            logger.exception("engine loop stopped")
            self._error = exc
            with self._lock:
                streams = list(self._streams.values())
            for stream in streams:
                stream.loop.call_soon_threadsafe(
                    stream.queue.put_nowait, EngineDeadError("the engine loop stopped")
                )

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams, in order: one call into each event loop per
        step, not one per output (each call wakes the loop, a system call and a contest for the
        GIL with this thread, 64 times a step at a full batch)."""
        batches: dict[asyncio.AbstractEventLoop, _Batch] = {}
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: _Batch) -> None:
    """On the event loop: each output into its stream's queue, in the step's order."""
    for queue, output in batch:
        queue.put_nowait(output)


def _is_not_first_token(output: RequestOutput) -> bool:
    """Sort key: a sample's first tokens before later ones (stable otherwise)."""
    return not output.new_token_ids or output.num_output_tokens > len(output.new_token_ids)
