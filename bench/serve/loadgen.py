"""The open-loop load generator: every planned request is sent at its time whatever the
server's state (a slow server does not slow the arrivals), as a streamed /v1/completions call
with a token-id prompt, and timed from the client's side.

Per request: the time to the first token, the gap before every later token, the end-to-end
time, the HTTP status (429s are shed requests when quotas are unlimited) and the usage the
server reported. Each streamed chunk carries one engine output, i.e. one token.

The client is aiohttp (its response parser is compiled): the generator shares the machine
with the server it measures, and each of its own milliseconds per chunk is both a
millisecond the server's steps lose to it and a delay it adds to the times it reports
(ops/bench/journal.md, "The load generator's own cost").
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import aiohttp

from bench.serve.errors import BenchConfigError
from bench.serve.plan import PlannedRequest
from bench.serve.progress import ProgressBar
from gateway.observability.loop_lag import LoopLagWatch, LoopStall

__all__ = ["CANCELLED", "CLIENT_LATE_S", "ClientLoopLag", "LoadGenerator", "RequestResult"]

# A request that sees no byte for this long is given up (the run would otherwise hang).
_READ_TIMEOUT_S = 600.0
# The generator's heartbeats later than this are kept (ClientLoopLag), with their times.
CLIENT_LATE_S = 0.01
# The error of a request the benchmark itself cancelled (closed loop, enough completed).
CANCELLED = "cancelled by the benchmark"


@dataclass
class RequestResult:
    """One request as the client saw it."""

    request_id: str
    tenant: str  # workload tenant name
    tier: str
    scheduled_s: float  # planned send time, seconds after the run's start
    sent_s: float  # actual send time, seconds after the run's start
    status_code: int  # HTTP status; 0 when the connection failed
    num_prompt_tokens: int
    num_output_tokens_requested: int  # max_tokens (ignore_eos)
    num_output_tokens: int = 0  # usage.completion_tokens, else the chunks received
    ttft_s: float | None = None  # send to first token; None when no token came
    e2e_s: float = 0.0  # send to the end of the response (a 429: to its arrival)
    # The server's own part of the time to the response's headers (its openai-processing-ms:
    # from reading the request to sending them); None when it sent none. The rest of a 429's
    # e2e_s is the network, the server's accept queue and this generator's own event loop.
    server_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gap before each token after the first
    error: str | None = None  # error message of a refusal or a failed stream

    @property
    def is_shed(self) -> bool:
        return self.status_code == 429

    @property
    def is_completed(self) -> bool:
        """Streamed to the end with every requested token."""
        return (
            self.status_code == 200
            and self.error is None
            and self.num_output_tokens == self.num_output_tokens_requested
        )

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    @property
    def token_times_s(self) -> list[float]:
        """When each token arrived, seconds after the run's start."""
        if self.ttft_s is None:
            return []
        times = [self.sent_s + self.ttft_s]
        for gap in self.itl_s:
            times.append(times[-1] + gap)
        return times

    @property
    def finish_s(self) -> float:
        """When the response ended, seconds after the run's start."""
        return self.sent_s + self.e2e_s


@dataclass
class ClientLoopLag:
    """This generator's own event loop over a run, timed by a heartbeat due every 10 ms
    (gateway.observability.loop_lag): a response that arrived while the loop was held is
    timed late by as much, on the client's side only."""

    num_beats: int = 0
    # (when the beat woke, seconds after the run's start; how late) of every beat late by
    # more than CLIENT_LATE_S
    late_beats: list[tuple[float, float]] = field(default_factory=list)
    # (when the beat woke, what held the loop) of every beat late by the stall bound
    # (gateway.observability.loop_lag.DEFAULT_STALL_S) or more: the loop thread's CPU time,
    # its wait for a CPU, the process's CPU time and the collector's pauses over it, where
    # the threads were
    stalls: list[tuple[float, LoopStall]] = field(default_factory=list)

    def observe(self, at_s: float, late_s: float) -> None:
        self.num_beats += 1
        if late_s > CLIENT_LATE_S:
            self.late_beats.append((at_s, late_s))

    def observe_stall(self, at_s: float, stall: LoopStall) -> None:
        self.stalls.append((at_s, stall))

    def stall_within(self, start_s: float, end_s: float) -> LoopStall | None:
        """The longest stall whose wait overlapped start_s..end_s, if any."""
        return max(
            (s for at_s, s in self.stalls if _overlaps(at_s, s.late_s, start_s, end_s)),
            key=lambda stall: stall.late_s,
            default=None,
        )

    def most_late_within(self, start_s: float, end_s: float) -> float:
        """The most a beat was late whose wait overlapped start_s..end_s (0: none over
        CLIENT_LATE_S)."""
        return max(
            (late for at_s, late in self.late_beats if _overlaps(at_s, late, start_s, end_s)),
            default=0.0,
        )


def _overlaps(at_s: float, late_s: float, start_s: float, end_s: float) -> bool:
    """Whether a beat that woke at at_s, late_s late, was held during start_s..end_s."""
    return at_s >= start_s and at_s - late_s <= end_s


class LoadGenerator:
    """Sends planned requests to one server, each with its tenant's key."""

    def __init__(
        self,
        base_url: str,
        model: str,
        keys: Mapping[str, str],
        *,
        progress: bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.keys = dict(keys)  # workload tenant -> API key
        self.progress = progress
        self.loop_lag: ClientLoopLag | None = None  # of the latest open-loop run

    async def run(
        self,
        plan: Sequence[PlannedRequest],
        label: str = "",
        *,
        before_last_send: Callable[[], object] | None = None,
    ) -> list[RequestResult]:
        """Send every request at its time; returns once all have ended, in plan order. Its
        own event loop's lag meanwhile is left in loop_lag. before_last_send, when given, is
        called in a worker thread when the last request is due, and that request sent once
        it returns (the streams in flight go on meanwhile)."""
        self._check_keys(plan)
        bar = ProgressBar(len(plan), label, enabled=self.progress)
        lag = ClientLoopLag()
        async with _session() as client:
            started = time.perf_counter()
            watch = LoopLagWatch(
                lambda late_s: lag.observe(time.perf_counter() - started, late_s),
                on_stall=lambda stall: lag.observe_stall(time.perf_counter() - started, stall),
            )
            await watch.start()
            try:
                tasks = []
                for index, planned in enumerate(plan):
                    delay = started + planned.send_at_s - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if before_last_send is not None and index == len(plan) - 1:
                        await asyncio.to_thread(before_last_send)
                    tasks.append(asyncio.create_task(self._send(client, planned, started, bar)))
                results = list(await asyncio.gather(*tasks))
            finally:
                await watch.stop()
        bar.close()
        self.loop_lag = lag
        return results

    async def run_closed_loop(
        self,
        plan: Sequence[PlannedRequest],
        concurrency: int,
        label: str = "",
        *,
        num_to_complete: int | None = None,
    ) -> list[RequestResult]:
        """Keep `concurrency` requests in flight, the next sent as soon as one ends (plan
        times are ignored; each result's scheduled time is its send time). With
        num_to_complete, the requests still in flight once that many have ended are
        cancelled (the server sees the disconnects; their results say CANCELLED; one that
        ends before the cancellation lands is kept as it is) and the ones never sent are
        left out."""
        self._check_keys(plan)
        target = len(plan) if num_to_complete is None else min(num_to_complete, len(plan))
        slots = asyncio.Semaphore(concurrency)
        enough = asyncio.Event()
        results: list[RequestResult] = []  # in the order they ended
        bar = ProgressBar(target, label, enabled=self.progress)
        async with _session() as client:
            started = time.perf_counter()

            async def send_when_free(planned: PlannedRequest) -> None:
                async with slots:
                    now_s = time.perf_counter() - started
                    await self._send(client, replace(planned, send_at_s=now_s), started, bar,
                                     sink=results)
                if sum(r.error != CANCELLED for r in results) >= target:
                    enough.set()

            tasks = [asyncio.create_task(send_when_free(p)) for p in plan]
            await enough.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()
        order = {p.request_id: index for index, p in enumerate(plan)}
        return sorted(results, key=lambda r: order[r.request_id])

    def _check_keys(self, plan: Sequence[PlannedRequest]) -> None:
        missing = {p.tenant for p in plan} - self.keys.keys()
        if missing:
            raise BenchConfigError(f"no API key for tenant(s) {', '.join(sorted(missing))}")

    async def _send(
        self,
        client: aiohttp.ClientSession,
        planned: PlannedRequest,
        started: float,
        bar: ProgressBar,
        *,
        sink: list[RequestResult] | None = None,
    ) -> RequestResult:
        """Send one request and time it; the result also goes to sink, even when the
        request is cancelled midway."""
        body = {
            "model": self.model,
            "prompt": list(planned.prompt_token_ids),
            "max_tokens": planned.num_output_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"authorization": f"Bearer {self.keys[planned.tenant]}"}
        sent = time.perf_counter()
        result = RequestResult(
            request_id=planned.request_id,
            tenant=planned.tenant,
            tier=planned.tier,
            scheduled_s=planned.send_at_s,
            sent_s=sent - started,
            status_code=0,
            num_prompt_tokens=len(planned.prompt_token_ids),
            num_output_tokens_requested=planned.num_output_tokens,
        )
        try:
            async with client.post(
                f"{self.base_url}/v1/completions", json=body, headers=headers
            ) as response:
                result.status_code = response.status
                result.server_s = _processing_s(response)
                if response.status != 200:
                    result.error = _error_message(response.status, await response.read())
                else:
                    await _read_stream(response, result, sent)
        except (aiohttp.ClientError, TimeoutError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        except (ValueError, KeyError, TypeError) as exc:  # a malformed event
            result.error = f"unreadable stream: {type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            result.error = CANCELLED
            raise
        finally:
            result.e2e_s = time.perf_counter() - sent
            if sink is not None:
                sink.append(result)
            if result.error != CANCELLED:
                bar.advance(is_shed=result.is_shed,
                            is_failed=not result.is_shed and not result.is_completed)
        return result


def _processing_s(response: aiohttp.ClientResponse) -> float | None:
    try:
        return float(response.headers["openai-processing-ms"]) / 1000
    except (KeyError, ValueError):
        return None


async def _read_stream(
    response: aiohttp.ClientResponse, result: RequestResult, sent: float
) -> None:
    last_token_at: float | None = None
    num_chunks = 0
    async for line in response.content:
        if not line.startswith(b"data: "):
            continue
        payload = line[len(b"data: "):].rstrip(b"\r\n")
        if payload == b"[DONE]":
            break
        now = time.perf_counter()
        event = json.loads(payload)
        if "error" in event:
            result.error = str(event["error"].get("message", event["error"]))
            break
        if event.get("choices"):
            num_chunks += 1
            if last_token_at is None:
                result.ttft_s = now - sent
            else:
                result.itl_s.append(now - last_token_at)
            last_token_at = now
        usage = event.get("usage")
        if usage:
            result.num_output_tokens = int(usage["completion_tokens"])
    if not result.num_output_tokens:
        result.num_output_tokens = num_chunks


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Cyclic garbage collection kept out of a timed stretch: a collection pauses the event
    loop, and the pause lands in the latencies it measures (full collections over the
    imports, torch and transformers, and over a run's own objects did: ops/bench/journal.md,
    "Runs 5 and 6" and "Runs 7 and 8"). What came before is collected first, then automatic
    collection is off until the stretch ends. Objects are still freed by reference counting;
    only reference cycles wait for the end, which bounds what they can hold."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.asynccontextmanager
async def _session() -> AsyncIterator[aiohttp.ClientSession]:
    """The client of one run, with no garbage collection while it runs (collector_paused):
    as many connections as requests in flight, kept alive between requests."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, connect=30.0, sock_read=_READ_TIMEOUT_S)
    with collector_paused():
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, trust_env=False
        ) as client:
            yield client


def _error_message(status: int, body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:200].decode(errors='replace')}"
