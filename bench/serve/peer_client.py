"""The peer benchmark's client: closed-loop streamed /v1/completions at a fixed concurrency,
the same code for every server, and the figures of one level.

N workers share one list of requests; each sends the next unsent request as soon as its
previous one ended, so N requests are in flight until the list runs out; each request on a
new loopback connection (no keep-alive, for both servers alike). Per request: TTFT
(send to the first chunk that carries a choice), e2e (send to the end of the stream), output
tokens (usage.completion_tokens when the server sends usage, else the chunks with a choice),
the prompt tokens the server reports (to check both servers saw the same prompt) and the
prompt tokens it served from its cache, when it says.

Per level: output tokens/s is every output token received over the level's wall time (first
send to last end); TTFT and TPOT percentiles (nearest rank) over the requests that got tokens,
TPOT = (e2e - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.stats import percentile

__all__ = ["LevelRun", "LevelStats", "PeerRequest", "PeerResult", "run_level", "send_one"]

# A request that sees no byte for this long is given up.
_READ_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class PeerRequest:
    request_id: str
    prompt: str
    num_prompt_tokens: int  # by the benchmark's tokenizer
    max_tokens: int  # the workload's output length; EOS is ignored


@dataclass
class PeerResult:
    request_id: str
    num_prompt_tokens: int  # as sent (the benchmark's count)
    max_tokens: int
    status_code: int = 0  # 0: the connection failed
    num_output_tokens: int = 0
    prompt_tokens_reported: int | None = None  # usage.prompt_tokens, if sent
    cached_prompt_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    ttft_s: float | None = None
    e2e_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status_code == 200 and self.error is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass
class LevelRun:
    """One concurrency level as the client saw it."""

    concurrency: int
    wall_s: float
    results: list[PeerResult] = field(default_factory=list)


def completion_body(model: str, request: PeerRequest) -> dict[str, Any]:
    """The request body both servers get (llama-server reads ignore_eos from the body too)."""
    return {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_one(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    request: PeerRequest,
    headers: Mapping[str, str],
) -> PeerResult:
    result = PeerResult(request.request_id, request.num_prompt_tokens, request.max_tokens)
    sent = time.perf_counter()
    try:
        async with session.post(
            f"{base_url}/v1/completions", json=completion_body(model, request), headers=headers
        ) as response:
            result.status_code = response.status
            if response.status != 200:
                body = await response.read()
                result.error = f"HTTP {response.status}: {body[:300].decode(errors='replace')}"
            else:
                await _read_stream(response, result, sent)
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    except (ValueError, KeyError, TypeError) as exc:
        result.error = f"unreadable stream: {type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - sent
    return result


async def _read_stream(response: aiohttp.ClientResponse, result: PeerResult, sent: float) -> None:
    num_chunks = 0
    async for line in response.content:
        if not line.startswith(b"data:"):
            continue
        payload = line[len(b"data:"):].strip()
        if payload == b"[DONE]":
            break
        now = time.perf_counter()
        event = json.loads(payload)
        if "error" in event:
            error = event["error"]
            result.error = str(error.get("message", error) if isinstance(error, dict) else error)
            break
        if event.get("choices"):
            num_chunks += 1
            if result.ttft_s is None:
                result.ttft_s = now - sent
        usage = event.get("usage")
        if usage:
            result.num_output_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                result.prompt_tokens_reported = int(usage["prompt_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                result.cached_prompt_tokens = int(details["cached_tokens"])
    if not result.num_output_tokens:
        result.num_output_tokens = num_chunks


async def run_level(
    base_url: str,
    model: str,
    requests: Sequence[PeerRequest],
    concurrency: int,
    *,
    api_key: str | None = None,
) -> LevelRun:
    """Every request, `concurrency` at a time (closed loop); results in request order."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, not {concurrency}")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[PeerResult | None] = [None] * len(requests)
    next_index = 0
    # A fresh connection per request: llama-server (cpp-httplib) closed kept-alive
    # connections after a stream, and a reused one failed with "Can not write request body".
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, connect=30.0, sock_read=_READ_TIMEOUT_S)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, trust_env=False
    ) as session:

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(requests):
                index = next_index
                next_index += 1
                results[index] = await send_one(
                    session, base_url, model, requests[index], headers
                )

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
        wall_s = time.perf_counter() - started
    return LevelRun(concurrency, wall_s, [r for r in results if r is not None])


@dataclass(frozen=True)
class LevelStats:
    """The figures of one system at one concurrency level (seconds; NaN: no sample)."""

    concurrency: int
    num_requests: int
    num_failed: int  # not 200, or an error in the stream
    num_short: int  # fewer output tokens than max_tokens although ignore_eos
    num_prompt_mismatch: int  # reported prompt_tokens differs from the benchmark's count
    num_output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    cached_prompt_tokens: int  # summed over requests that reported it

    @classmethod
    def of(cls, run: LevelRun) -> LevelStats:
        results = run.results
        ttfts = sorted(r.ttft_s for r in results if r.ok and r.ttft_s is not None)
        tpots = sorted(t for r in results if r.ok and (t := r.tpot_s) is not None)
        num_output = sum(r.num_output_tokens for r in results)
        return cls(
            concurrency=run.concurrency,
            num_requests=len(results),
            num_failed=sum(not r.ok for r in results),
            num_short=sum(r.ok and r.num_output_tokens < r.max_tokens for r in results),
            num_prompt_mismatch=sum(
                r.prompt_tokens_reported is not None
                and r.prompt_tokens_reported != r.num_prompt_tokens
                for r in results
            ),
            num_output_tokens=num_output,
            wall_s=run.wall_s,
            output_tokens_per_s=num_output / run.wall_s if run.wall_s > 0 else math.nan,
            ttft_p50_s=percentile(ttfts, 50),
            ttft_p99_s=percentile(ttfts, 99),
            tpot_p50_s=percentile(tpots, 50),
            tpot_p99_s=percentile(tpots, 99),
            cached_prompt_tokens=sum(r.cached_prompt_tokens or 0 for r in results),
        )
