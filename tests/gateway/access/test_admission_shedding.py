"""SLO shedding through one real `tiergate serve` process under overload: standard requests
are refused at once with a retry delay that holds, premium requests keep being admitted.

The tier table is the default one with every latency objective scaled by SLO_SCALE for the
CPU demo model: standard's TTFT objective becomes 1 s (shed over 0.8 s of estimated queue
wait), premium's 0.25 s (premium also keeps its 30 % KV reservation, so it is not shed while
that has room).

The overload is sized from the machine's measured speed, not fixed: the warm-up times batches
of requests like the overload's, and the standard clients then arrive at OVERLOAD times the rate the
engine served them, for long enough that the queue's wait passes the shedding threshold
several times over. A fixed count was an overload on a loaded machine and none on an idle one.
Every prompt is distinct, so each is computed: with one shared prompt nearly all of it was a
prefix-cache hit. The test servers' 16 MiB KV pool holds about 9 of these requests beside
premium's reservation, so the queue waits for memory, not for prefill.

The server has this test to itself: the engine's measured prefill rate, which the estimate
divides by, then comes from this load and not from another test's.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.serve.loadgen import collector_paused
from gateway.access.admission import AdmissionSettings
from policies import TierTable
from tests.gateway.admission_support import (
    RATE_LIMIT_HEADERS,
    SERVER_START_TIMEOUT_S,
    assert_openai_error,
    completion_body,
    create_tenant,
    quantiles_ms,
    report,
    send_all,
    write_config,
)
from tests.serve_process import ServeProcess

SLO_SCALE = 0.5
TIERS = TierTable().scaled(SLO_SCALE)
_STANDARD_TTFT_SLO_S = TIERS["standard"].ttft_slo_s
assert _STANDARD_TTFT_SLO_S is not None
SHED_THRESHOLD_S = AdmissionSettings().shed_slo_fraction * _STANDARD_TTFT_SLO_S
OVERLOAD = 4.0  # standard arrival rate over the rate the engine served the warm-up
MIN_STANDARD_CLIENTS = 40
MAX_STANDARD_CLIENTS = 400
NUM_WARM_UP = 8
NUM_PROMPT_TOKENS = 300
MAX_RETRIES = 10
# Limits no test request reaches, so the x-ratelimit-* headers exist and only shedding refuses.
GENEROUS = {"requests_per_minute": 100_000, "tokens_per_minute": 10**8}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    directory = tmp_path_factory.mktemp("admission-shedding")
    tiers = [asdict(tier) for tier in TIERS]
    config = write_config(directory / "config.json", {"tiers": tiers})
    with ServeProcess(
        f"sqlite:///{directory / 'tiergate.db'}", args=["--config", str(config)]
    ).start(SERVER_START_TIMEOUT_S) as process:
        yield process


@dataclass
class _StandardClient:
    """One standard-tier client: a request, and on 429 retries, each after the retry-after-ms
    of the refusal before it, until admitted (at most MAX_RETRIES)."""

    status_code: int = 0
    latency_s: float = 0.0  # until the first answer was read
    headers: httpx.Headers | None = None
    error: dict[str, object] | None = None  # the 429's OpenAI error object
    retry_after_ms: int | None = None  # the first refusal's
    retry_status_codes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Overload:
    """The standard clients' arrivals, from the warm-up's measured service time."""

    service_s: float  # wall time of the warm-up batch over its requests
    num_clients: int
    arrival_gap_s: float

    @classmethod
    def from_warm_up(cls, warm_up_s: float, num_admitted: int) -> _Overload:
        service_s = warm_up_s / num_admitted
        gap_s = service_s / OVERLOAD
        # The backlog's wait grows by (OVERLOAD - 1) seconds a second of arrivals; arrive for
        # long enough that it reaches 3x the shedding threshold.
        arrivals_s = 3 * SHED_THRESHOLD_S / (OVERLOAD - 1)
        num_clients = math.ceil(arrivals_s / gap_s)
        return cls(
            service_s, max(MIN_STANDARD_CLIENTS, min(MAX_STANDARD_CLIENTS, num_clients)), gap_s
        )


def _standard_counts(server: ServeProcess) -> Counter[tuple[str, int]]:
    """The standard tier's tiergate_requests_total by (status, code), and its shed refusals
    (tiergate_rejections_total, reason slo_shed) as ("shed", 0)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    counts: Counter[tuple[str, int]] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("tier") != "standard":
                continue
            if sample.name == "tiergate_requests_total":
                counts[(sample.labels["status"], int(sample.labels["code"]))] += int(sample.value)
            elif (
                sample.name == "tiergate_rejections_total" and sample.labels["reason"] == "slo_shed"
            ):
                counts[("shed", 0)] += int(sample.value)
    return counts


def _settled_increase(
    server: ServeProcess, before: Counter[tuple[str, int]], expected: Counter[tuple[str, int]]
) -> Counter[tuple[str, int]]:
    """The counts' increase since before, once it reaches expected (ended requests reach the
    metrics just after their answer) or after 30 s."""
    deadline_s = time.monotonic() + 30
    while True:
        increase = _standard_counts(server)
        increase.subtract(before)
        increase = +increase  # drop the series that did not move
        if increase == expected or time.monotonic() > deadline_s:
            return increase
        time.sleep(0.1)


async def _overload(
    base_url: str, standard_key: str, premium_key: str, overload: _Overload, first_prompt_seed: int
) -> tuple[list[_StandardClient], list[int]]:
    """The standard clients' distinct prompts have the seeds first_prompt_seed onwards."""
    limits = httpx.Limits(max_connections=overload.num_clients + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as http:

        async def standard(index: int) -> _StandardClient:
            await asyncio.sleep(index * overload.arrival_gap_s)
            client = _StandardClient()
            body = completion_body(NUM_PROMPT_TOKENS, 16, first_prompt_seed + index)
            headers = {"authorization": f"Bearer {standard_key}"}
            start_s = time.monotonic()
            response = await http.post("/v1/completions", json=body, headers=headers)
            client.latency_s = time.monotonic() - start_s
            client.status_code = response.status_code
            client.headers = response.headers
            if response.status_code == 429:
                client.error = response.json()["error"]
                client.retry_after_ms = int(response.headers["retry-after-ms"])
                retry = response
                while retry.status_code == 429 and len(client.retry_status_codes) < MAX_RETRIES:
                    await asyncio.sleep(int(retry.headers["retry-after-ms"]) / 1000)
                    retry = await http.post("/v1/completions", json=body, headers=headers)
                    client.retry_status_codes.append(retry.status_code)
            return client

        async def premium() -> list[int]:
            statuses = []
            headers = {"authorization": f"Bearer {premium_key}"}
            for _ in range(12):
                body = completion_body(20, 4)
                response = await http.post("/v1/completions", json=body, headers=headers)
                statuses.append(response.status_code)
                await asyncio.sleep(0.05)
            return statuses

        premium_task = asyncio.ensure_future(premium())
        clients = await asyncio.gather(*(standard(i) for i in range(overload.num_clients)))
        return list(clients), await premium_task


def test_overload_sheds_standard_fast_with_truthful_retry_after_premium_admitted(
    server: ServeProcess,
) -> None:
    standard_key = create_tenant(server, GENEROUS, tier="standard")
    premium_key = create_tenant(server, GENEROUS, tier="premium")
    # Warm up: the engine measures its prefill rate on batches like the overload's, and the
    # second round sizes the overload. Every prompt is distinct: prefix-cache hits would make
    # the overload's prompts nearly free. On a slow host a round of distinct prompts can
    # itself pass the shedding threshold, and then its last requests are rightly shed: the
    # round's admitted requests size the overload.
    # The faster round sizes the overload: a round slowed by something else on the host (one
    # CI run measured 240 ms a request against 64 ms alone) made arrivals at 4x its rate no
    # overload once the host was quick again (38 of 40 admitted).
    prompt_seeds = itertools.count()
    warm_up_statuses: list[list[int]] = []
    overloads: list[_Overload] = []
    for _ in range(2):
        warm_up = [
            completion_body(NUM_PROMPT_TOKENS, 16, next(prompt_seeds)) for _ in range(NUM_WARM_UP)
        ]
        start_s = time.monotonic()
        outcomes = send_all([server], standard_key, warm_up, concurrency_per_server=NUM_WARM_UP)
        warm_up_s = time.monotonic() - start_s
        statuses = [o.status_code for o in outcomes]
        for outcome in outcomes:
            if outcome.status_code != 200:
                assert_openai_error(outcome, 429, "rate_limit_exceeded")
        num_warmed_up = statuses.count(200)
        assert num_warmed_up, statuses
        warm_up_statuses.append(statuses)
        overloads.append(_Overload.from_warm_up(warm_up_s, num_warmed_up))
    overload = min(overloads, key=lambda o: o.service_s)

    before = _standard_counts(server)
    # Timed: no garbage collection meanwhile. Late in the test session a full collection of
    # this process's heap (~700,000 objects) took 0.63 s, and one during the overload would
    # be timed as the refusals' latency (median 333 ms in one CI run).
    with collector_paused():
        clients, premium_statuses = asyncio.run(
            _overload(server.base_url, standard_key, premium_key, overload, next(prompt_seeds))
        )
    shed = [c for c in clients if c.status_code == 429]
    admitted = [c for c in clients if c.status_code == 200]
    assert len(shed) + len(admitted) == len(clients), [c.status_code for c in clients]
    admitted_p50_ms, _, admitted_max_ms = (
        quantiles_ms([c.latency_s for c in admitted]) if admitted else (0.0, 0.0, 0.0)
    )
    summary = (
        f"{len(clients)} standard clients of {NUM_PROMPT_TOKENS}-token prompts every "
        f"{1000 * overload.arrival_gap_s:.1f} ms (warm-up rounds: "
        f"{', '.join(f'{1000 * o.service_s:.1f}' for o in overloads)} ms a request, "
        f"statuses {warm_up_statuses}), SLO scale {SLO_SCALE}: "
        f"{len(admitted)} admitted (latency p50 {admitted_p50_ms:.0f} ms, max "
        f"{admitted_max_ms:.0f} ms), {len(shed)} shed"
    )
    assert len(shed) >= 5 and len(admitted) >= 3, summary
    for client in shed:
        assert client.error is not None and client.headers is not None
        assert client.error["code"] == "rate_limit_exceeded", client.error
        assert "overloaded for the standard tier" in str(client.error["message"]), client.error
        assert set(client.headers) >= RATE_LIMIT_HEADERS, client.headers
    num_first_retries_ok = sum(c.retry_status_codes[0] == 200 for c in shed)
    num_retries = sum(len(c.retry_status_codes) for c in shed)
    p50_ms, p99_ms, max_ms = quantiles_ms([c.latency_s for c in shed])
    report(
        f"overload, {summary}; "
        f"429 latency p50 {p50_ms:.1f} ms, p99 {p99_ms:.1f} ms, "
        f"max {max_ms:.1f} ms; retry-after-ms {sorted(c.retry_after_ms or 0 for c in shed)}; "
        f"first retry after retry-after-ms admitted {num_first_retries_ok}/{len(shed)}, "
        f"{num_retries} retries in all; "
        f"premium {premium_statuses}"
    )
    # Refused at once: a shed request is answered without waiting for the engine, so the
    # median refusal is far quicker than the median admitted request of the same run (about
    # 100x here). The absolute target (< 50 ms p99) is a wall-clock claim, reported above and
    # in the serving benchmark, not gated on a shared CI machine.
    assert p50_ms < admitted_p50_ms / 10, (p50_ms, admitted_p50_ms)
    # Every 429 was a shedding decision that ran nothing, as the server counted it.
    answers = [c.status_code for c in clients] + [r for c in shed for r in c.retry_status_codes]
    expected = Counter(
        {("refused", 429): answers.count(429), ("completed", 200): answers.count(200),
         ("shed", 0): answers.count(429)}
    )  # fmt: skip
    assert _settled_increase(server, before, expected) == expected
    # The retry delay is truthful: following it, every shed client gets in, at two tries or
    # fewer on average (over 7 runs, 5 alone and 2 beside two busy loops: first retries got
    # in 56-84 % of the time, 1.16-1.50 tries on average; a delay at the 100 ms floor against
    # backlogs of 1-3 s would take several times that). A retry can still be refused:
    # requests arriving meanwhile and admitted take the room it was promised.
    assert all(c.retry_status_codes[-1] == 200 for c in shed), [c.retry_status_codes for c in shed]
    assert num_retries <= 2 * len(shed), num_retries
    # Premium is never shed while standard is.
    assert premium_statuses == [200] * len(premium_statuses)
