"""Observability end to end through the real app, over HTTP: a slowed engine pages a webhook
once and resolves once; /metrics agrees with what the client measured and saw; each request's
span carries the GenAI attributes; requests refused before admission are counted as invalid.

The replica runs in this process (tests/gateway/app_harness.py) so the tests can slow its
engine and read its spans; clients are the openai SDK and httpx on loopback.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from billing import UsageRecordRow
from gateway.observability.metrics import TTFT_BUCKETS_S
from gateway.observability.telemetry import TelemetrySettings, setup_telemetry
from gateway.server.model_source import DEMO_MODEL_NAME
from gateway.server.observability_wiring import UNKNOWN_TIER
from policies.alerts import ALERT_NAME
from tests.gateway.app_harness import InProcessGateway, start_gateway
from tests.gateway.loopback_receiver import LoopbackReceiver
from tests.gateway.observability.test_metrics import histogram_quantile

MODEL = DEMO_MODEL_NAME
MAX_BODY_BYTES = 32 * 1024
# Never shed in these tests: the slowed engine would otherwise refuse the traffic it measures.
NO_SHEDDING = {"admission": {"enable_shedding": False}}
NEVER_LIMITED = {"requests_per_minute": 100_000, "tokens_per_minute": 10_000_000}
# One request a minute: the second one is refused (429, reason rate_limit_requests).
ONE_PER_MINUTE = {"requests_per_minute": 1, "burst_requests": 1}


def _messages(text: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": text}]


# -- scraping ---------------------------------------------------------------------------------

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(gateway: InProcessGateway) -> Samples:
    """The admin scrape: tenant labels included (anonymous /metrics sums them away)."""
    with gateway.admin() as admin:
        text = admin.get("/admin/v1/metrics", timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def increase(before: Samples, after: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """The series of sample name that went up between two scrapes, by label set."""
    return {
        labels: value - before.get((sample, labels), 0.0)
        for (sample, labels), value in after.items()
        if sample == name and value != before.get((sample, labels), 0.0)
    }


def requests_increase(before: Samples, after: Samples) -> Counter[tuple[str, str, int]]:
    """tiergate_requests_total's increase by (tier, status, code)."""
    counts: Counter[tuple[str, str, int]] = Counter()
    for labels, value in increase(before, after, "tiergate_requests_total").items():
        label = dict(labels)
        counts[(label["tier"], label["status"], int(label["code"]))] += int(value)
    return counts


def settled_scrape(
    gateway: InProcessGateway, before: Samples, expected: Counter[tuple[str, str, int]]
) -> Samples:
    """A scrape once tiergate_requests_total has risen by expected since before, or the last
    one after 30 s: a refusal reaches the metrics in the background, after the ledger's
    commit, so its 429 can reach the client first."""
    deadline_s = time.monotonic() + 30
    while True:
        after = scrape(gateway)
        if requests_increase(before, after) == expected or time.monotonic() > deadline_s:
            return after
        time.sleep(0.05)


# -- the shared replica -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, spans: InMemorySpanExporter
) -> Iterator[InProcessGateway]:
    with start_gateway(
        tmp_path_factory.mktemp("observability"),
        file_config=NO_SHEDDING,
        telemetry=setup_telemetry(TelemetrySettings(), span_exporter=spans),
        max_body_bytes=MAX_BODY_BYTES,
    ) as running:
        yield running


@dataclass
class Caller:
    tenant_id: int
    tier: str
    key: str
    client: openai.OpenAI


def new_caller(
    gateway: InProcessGateway, name: str, tier: str, quota: dict[str, Any] | None = None
) -> Caller:
    tenant_id, key = gateway.create_tenant(name, tier, quota or NEVER_LIMITED)
    return Caller(tenant_id, tier, key, gateway.openai_client(key))


# -- 1. paging ----------------------------------------------------------------------------------

ALERTS_PATH = "/api/v2/alerts"
# A short window and a for_s twice as long: a stall of this shared machine makes the
# TTFTs of the requests it held slow, and they leave the window before they could page
# unless the slowness is spread over window_s; only a slowdown that lasts pages.
PREMIUM_RULE = {"threshold_s": 0.4, "window_s": 2.0, "for_s": 4.0, "min_samples": 3}
SLOW_STEP_S = 0.8  # added to every engine step while the engine is "slow"


class PremiumTraffic:
    """Workers sending premium chat requests back to back until stopped."""

    def __init__(self, base_url: str, key: str, num_workers: int) -> None:
        self._stop = threading.Event()
        self.codes: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._work, args=(base_url, key, i), daemon=True)
            for i in range(num_workers)
        ]

    def __enter__(self) -> PremiumTraffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _work(self, base_url: str, key: str, worker: int) -> None:
        headers = {"authorization": f"Bearer {key}"}
        with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
            for i in range(1_000_000):
                if self._stop.is_set():
                    return
                body = {"model": MODEL, "messages": _messages(f"worker {worker} turn {i}"),
                        "max_tokens": 1}  # fmt: skip
                code = client.post("/v1/chat/completions", json=body).status_code
                with self._lock:
                    self.codes[code] += 1


def _wait_for_posts(receiver: LoopbackReceiver, count: int, timeout_s: float) -> float:
    """The time (time.monotonic) when the receiver was seen holding count alert posts."""
    started = time.monotonic()
    while len(receiver.posts(ALERTS_PATH)) < count:
        assert time.monotonic() - started < timeout_s, receiver.posts(ALERTS_PATH)
        time.sleep(0.05)
    return time.monotonic()


def _inactive_since(admin: httpx.Client, timeout_s: float) -> float:
    """A time (time.monotonic) before a moment the premium alert was inactive, polling until
    it is: a passing stall may hold it pending for a while."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        asked_at_s = time.monotonic()
        state = _premium_alert(admin)["state"]
        if state == "inactive":
            return asked_at_s
        assert asked_at_s < deadline_s, state
        time.sleep(0.05)


def _premium_alert(admin: httpx.Client) -> dict[str, Any]:
    alerts = admin.get("/admin/v1/alerts").json()["alerts"]
    (premium,) = [a for a in alerts if a["tier"] == "premium"]
    return dict(premium)


def test_slow_engine_pages_once_then_resolves_once(tmp_path: Path) -> None:
    receiver = LoopbackReceiver()
    config = {
        **NO_SHEDDING,
        "alerts": {
            "replica": "e2e-replica",
            "evaluate_interval_s": 0.1,
            "ttft_p99": {"premium": PREMIUM_RULE},
            "webhooks": [{"url": receiver.url(ALERTS_PATH), "format": "alertmanager"}],
        },
    }
    running = start_gateway(tmp_path, file_config=config)
    try:
        _, key = running.create_tenant("pager", "premium", NEVER_LIMITED)
        # The replica's first request pays one-off costs (chat template, connections).
        body = {"model": MODEL, "messages": _messages("warm-up"), "max_tokens": 1}
        warm_up = httpx.post(f"{running.base_url}/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}, timeout=30)  # fmt: skip
        assert warm_up.status_code == 200
        with (
            PremiumTraffic(running.base_url, key, num_workers=6) as traffic,
            running.admin() as admin,
        ):
            time.sleep(1.5)
            assert receiver.posts(ALERTS_PATH) == [], "paged while healthy"
            # Pending can start only after the alert was last seen inactive, and the breach
            # must then last for_s before it pages.
            inactive_at_s = _inactive_since(admin, timeout_s=30)
            running.runner.extra_delay_s = SLOW_STEP_S
            fired_at_s = _wait_for_posts(receiver, 1, timeout_s=20)
            assert fired_at_s - inactive_at_s >= PREMIUM_RULE["for_s"]
            alert = _premium_alert(admin)
            assert alert["state"] == "firing" and alert["value"] > PREMIUM_RULE["threshold_s"]
            live = admin.get("/admin/v1/live").json()
            (premium_row,) = [row for row in live["tiers"] if row["tier"] == "premium"]
            assert premium_row["ttft_p99_s"] > PREMIUM_RULE["threshold_s"]
            firing = scrape(running)[
                ("tiergate_alert_firing",
                 frozenset({"alertname": ALERT_NAME, "tier": "premium"}.items()))
            ]  # fmt: skip
            assert firing == 1.0
            time.sleep(1.0)  # still slow: still one page, no repeats
            assert len(receiver.posts(ALERTS_PATH)) == 1

            running.runner.extra_delay_s = 0.0
            _wait_for_posts(receiver, 2, timeout_s=PREMIUM_RULE["window_s"] + 10)
            # Healthy traffic for longer than window and for_s together: nothing more (two
            # posts, below). Not firing; "resolved" unless a passing stall of this shared
            # machine put the window over the threshold for less than for_s since (pending,
            # then inactive, and no page: the rule doing its job, not a failure).
            time.sleep(PREMIUM_RULE["window_s"] + PREMIUM_RULE["for_s"])
            assert _premium_alert(admin)["state"] != "firing"
        posts = receiver.posts(ALERTS_PATH)
        assert len(posts) == 2, [p.json() for p in posts]
        (fire,), (resolve,) = (p.json() for p in posts)
        for alert_body in (fire, resolve):
            assert alert_body["labels"] == {
                "alertname": ALERT_NAME, "tier": "premium", "severity": "page",
                "service": "tiergate", "replica": "e2e-replica",
            }  # fmt: skip
            assert alert_body["startsAt"] == fire["startsAt"]
        assert "endsAt" not in fire and "endsAt" in resolve
        assert float(fire["annotations"]["value_s"]) >= SLOW_STEP_S
        assert set(traffic.codes) == {200}, traffic.codes
        assert sum(traffic.codes.values()) >= 20
    finally:
        running.runner.extra_delay_s = 0.0
        running.stop()
        receiver.close()


# -- 2. metrics agree with the client ------------------------------------------------------------


def _stream_ttft_s(client: httpx.Client, text: str) -> float:
    """Client-side TTFT of one streamed chat: request sent to its first data event (each
    request is one token, so the first event carries it)."""
    body = {"model": MODEL, "messages": _messages(text), "max_tokens": 1, "stream": True}
    started = time.monotonic()
    first_s = None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if first_s is None and line.startswith("data: {"):
                first_s = time.monotonic() - started
    assert first_s is not None
    return first_s


def _ttft_buckets(before: Samples, after: Samples, tier: str) -> list[tuple[float, float]]:
    buckets = []
    for (name, labels), value in after.items():
        label = dict(labels)
        if name == "tiergate_ttft_seconds_bucket" and label["tier"] == tier:
            buckets.append((float(label["le"]), value - before.get((name, labels), 0.0)))
    return sorted(buckets)


# Engine step time of the TTFT load: a request waits for the step in flight, then runs in its
# own, so TTFTs fall between 0.55 s and ~1.5 s, where buckets are 0.1-0.25 s wide. Reading raw
# SSE lines keeps the client's own overhead small, but client and server share this process and
# two busy cores: one stall of a few hundred ms before the server's clock starts (seen in CI: a
# client max of 1.59 s against a server max under 1.25 s) moves the client's p99, which over 24
# requests is their maximum. So the test asserts what holds exactly (each server TTFT lies inside
# its client's, so the histogram never counts fewer requests under a bound than the client saw)
# and compares the medians, which one outlier does not move.
TTFT_STEP_S = 0.55


def test_ttft_histogram_agrees_with_what_the_clients_measured(gateway: InProcessGateway) -> None:
    caller = new_caller(gateway, "ttft-load", "premium")
    num_requests = 24
    headers = {"authorization": f"Bearer {caller.key}"}
    with httpx.Client(base_url=gateway.base_url, headers=headers, timeout=30) as client:
        before = scrape(gateway)
        gateway.runner.extra_delay_s = TTFT_STEP_S
        try:
            with ThreadPoolExecutor(4) as pool:
                client_ttfts_s = list(pool.map(
                    lambda i: _stream_ttft_s(client, f"load {i}: what is the weather?"),
                    range(num_requests),
                ))  # fmt: skip
        finally:
            gateway.runner.extra_delay_s = 0.0
    after = scrape(gateway)

    buckets = _ttft_buckets(before, after, "premium")
    assert buckets[-1] == (math.inf, num_requests)
    ranked = sorted(client_ttfts_s)
    for bound_s, num_server in buckets:
        num_client = bisect.bisect_right(ranked, bound_s)
        assert num_server >= num_client, (bound_s, num_server, num_client, ranked)

    # The median, within a bucket: the server's clock misses only overhead, not a step.
    server_p50_s = histogram_quantile(0.5, buckets)
    client_p50_s = ranked[math.ceil(0.5 * len(ranked)) - 1]
    server_bucket = bisect.bisect_left(TTFT_BUCKETS_S, server_p50_s)
    client_bucket = bisect.bisect_left(TTFT_BUCKETS_S, client_p50_s)
    assert abs(server_bucket - client_bucket) <= 1, (server_p50_s, client_p50_s)
    print(
        f"TTFT p50 server {server_p50_s:.3f} s, client {client_p50_s:.3f} s; p99 server "
        f"{histogram_quantile(0.99, buckets):.3f} s, client {ranked[-1]:.3f} s"
    )
    # The server starts its clock after the client and stops it before the chunk is sent.
    labels = frozenset({"tier": "premium"}.items())
    server_sum_s = after[("tiergate_ttft_seconds_sum", labels)] - before.get(
        ("tiergate_ttft_seconds_sum", labels), 0.0
    )
    assert 0 < server_sum_s <= sum(client_ttfts_s)


@dataclass(frozen=True)
class Seen:
    """One response as the client saw it."""

    tier: str  # the tier label the gateway should use: the caller's, or unknown if invalid
    status: str  # completed, refused or invalid
    code: int
    tenant_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_completion_tokens: int = 0


# Three KV blocks of the same words before each premium question: later requests read the
# first one's blocks from the prefix cache (cached_prompt tokens).
SHARED_PREFIX = " ".join(["The gateway accepts requests from many tenants."] * 6)


def _completed(caller: Caller, usage: CompletionUsage | None) -> Seen:
    assert usage is not None
    details = usage.prompt_tokens_details
    num_cached = (details.cached_tokens or 0) if details is not None else 0
    return Seen(
        caller.tier, "completed", 200, caller.tenant_id, usage.prompt_tokens, num_cached,
        usage.completion_tokens,
    )


def _chat(caller: Caller, index: int, stream: bool, prefix: str = "") -> Seen:
    text, max_tokens = f"{prefix}counter {index}: tell me a story about bread", 2 + index % 7
    try:
        if stream:
            chunks = list(caller.client.chat.completions.create(
                model=MODEL, messages=_messages(text), max_tokens=max_tokens, stream=True,
                stream_options={"include_usage": True},
            ))  # fmt: skip
            usage = chunks[-1].usage
        else:
            usage = caller.client.chat.completions.create(
                model=MODEL, messages=_messages(text), max_tokens=max_tokens
            ).usage
    except openai.RateLimitError as exc:
        return Seen(caller.tier, "refused", exc.status_code)
    return _completed(caller, usage)


def _completion(caller: Caller, index: int) -> Seen:
    usage = caller.client.completions.create(
        model=MODEL, prompt=f"Once upon a time {index}", max_tokens=4
    ).usage
    return _completed(caller, usage)


def _invalid(base_url: str, key: str, kind: str) -> Seen:
    headers = {"authorization": f"Bearer {key}"}
    url = f"{base_url}/v1/chat/completions"
    if kind == "bad key":
        response = httpx.post(url, json={"model": MODEL, "messages": _messages("x")},
                              headers={"authorization": "Bearer tg-nope"})  # fmt: skip
    elif kind == "bad body":
        response = httpx.post(url, json={"model": MODEL, "messages": "x"}, headers=headers)
    else:
        response = httpx.post(url, json={"model": "gpt-9", "messages": _messages("x")},
                              headers=headers)  # fmt: skip
    return Seen(UNKNOWN_TIER, "invalid", response.status_code)


def test_request_and_token_counters_match_what_the_client_saw(
    gateway: InProcessGateway,
) -> None:
    premium = new_caller(gateway, "counted-premium", "premium")
    standard = new_caller(gateway, "counted-standard", "standard")
    throttled = new_caller(gateway, "counted-throttled", "standard", ONE_PER_MINUTE)
    jobs: list[Callable[[], Seen]] = [
        *(lambda i=i: _chat(premium, i, i % 2 == 0, SHARED_PREFIX) for i in range(10)),
        *(lambda i=i: _completion(standard, i) for i in range(4)),
        *(lambda i=i: _chat(standard, 100 + i, stream=True) for i in range(3)),
        *(lambda i=i: _chat(throttled, 200 + i, stream=i % 2 == 1) for i in range(3)),
        *(lambda kind=kind: _invalid(gateway.base_url, premium.key, kind)
          for kind in ("bad key", "bad key", "bad body", "unknown model")),
    ]  # fmt: skip
    before = scrape(gateway)
    seen = [_chat(premium, -1, False, SHARED_PREFIX)]  # fills the prefix cache
    with ThreadPoolExecutor(4) as pool:
        seen += pool.map(lambda job: job(), jobs)

    client_counts = Counter((s.tier, s.status, s.code) for s in seen)
    after = settled_scrape(gateway, before, client_counts)
    assert client_counts[("standard", "refused", 429)] == 2  # the load is what we meant
    assert client_counts[(UNKNOWN_TIER, "invalid", 401)] == 2
    assert requests_increase(before, after) == client_counts
    rejections = increase(before, after, "tiergate_rejections_total")
    assert rejections == {
        frozenset({"tier": "standard", "reason": "rate_limit_requests"}.items()): 2.0
    }
    tokens = increase(before, after, "tiergate_tokens_total")
    expected: Counter[frozenset[tuple[str, str]]] = Counter()
    for s in seen:
        for kind, num_tokens in (
            ("prompt", s.num_prompt_tokens),
            ("cached_prompt", s.num_cached_prompt_tokens),
            ("completion", s.num_completion_tokens),
        ):
            if num_tokens:
                labels = {"tier": s.tier, "model": DEMO_MODEL_NAME, "tenant": str(s.tenant_id),
                          "kind": kind}
                expected[frozenset(labels.items())] += num_tokens
    assert tokens == expected
    assert sum(s.num_cached_prompt_tokens for s in seen) >= 32  # the cache was exercised


# -- 3. traces --------------------------------------------------------------------------------


def _request_spans(spans: InMemorySpanExporter) -> tuple[ReadableSpan, dict[str, ReadableSpan]]:
    """The one request span and its children by name."""
    finished = spans.get_finished_spans()
    (root,) = [span for span in finished if span.parent is None]
    children = {span.name: span for span in finished if span.parent is not None}
    assert len(children) == len(finished) - 1, "a phase span twice"
    for child in children.values():
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
    return root, children


def _check_phases(root: ReadableSpan, children: dict[str, ReadableSpan]) -> None:
    assert set(children) == {"admission", "queue", "prefill", "decode"}
    admission, queue = children["admission"], children["queue"]
    prefill, decode = children["prefill"], children["decode"]
    assert root.start_time is not None and root.end_time is not None
    assert admission.start_time is not None and admission.end_time is not None
    assert root.start_time <= admission.start_time <= admission.end_time
    assert queue.start_time is not None and admission.end_time <= queue.start_time
    # The phases tile the time from handing the request to the engine to its end.
    assert queue.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time
    assert decode.end_time == root.end_time
    for span in children.values():
        assert span.status.status_code is StatusCode.UNSET


# The sampling parameters of the traced requests, and their span attributes.
MAX_TOKENS, TEMPERATURE, TOP_P, SEED = 6, 0.5, 0.9, 11


def _expected_attributes(caller: Caller, *, stream: bool) -> dict[str, Any]:
    return {
        gen_ai.GEN_AI_OPERATION_NAME: "chat",
        gen_ai.GEN_AI_PROVIDER_NAME: "tiergate",
        gen_ai.GEN_AI_REQUEST_MODEL: MODEL,
        gen_ai.GEN_AI_REQUEST_MAX_TOKENS: MAX_TOKENS,
        gen_ai.GEN_AI_REQUEST_TEMPERATURE: TEMPERATURE,
        gen_ai.GEN_AI_REQUEST_TOP_P: TOP_P,
        gen_ai.GEN_AI_REQUEST_SEED: SEED,
        gen_ai.GEN_AI_REQUEST_STREAM: stream,
        gen_ai.GEN_AI_RESPONSE_MODEL: MODEL,
        "tiergate.tier": caller.tier,
        "tiergate.tenant_id": str(caller.tenant_id),
    }


def test_chat_span_carries_the_genai_attributes(
    gateway: InProcessGateway, spans: InMemorySpanExporter
) -> None:
    caller = new_caller(gateway, "traced", "premium")
    spans.clear()
    completion = caller.client.chat.completions.create(
        model=MODEL, messages=_messages("trace me"), max_tokens=MAX_TOKENS,
        temperature=TEMPERATURE, top_p=TOP_P, seed=SEED,
    )
    root, children = _request_spans(spans)
    assert root.name == f"chat {MODEL}" and root.kind is SpanKind.SERVER
    assert root.status.status_code is StatusCode.UNSET
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert dict(root.attributes or {}) == _expected_attributes(caller, stream=False) | {
        gen_ai.GEN_AI_RESPONSE_ID: completion.id,
        gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: (completion.choices[0].finish_reason,),
        gen_ai.GEN_AI_USAGE_INPUT_TOKENS: usage.prompt_tokens,
        gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: usage.completion_tokens,
        gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: usage.prompt_tokens_details.cached_tokens,
    }
    _check_phases(root, children)


def test_streamed_chat_span_carries_the_genai_attributes(
    gateway: InProcessGateway, spans: InMemorySpanExporter
) -> None:
    caller = new_caller(gateway, "traced-stream", "standard")
    spans.clear()
    chunks = list(caller.client.chat.completions.create(
        model=MODEL, messages=_messages("trace my stream"), stream=True,
        stream_options={"include_usage": True}, max_tokens=MAX_TOKENS,
        temperature=TEMPERATURE, top_p=TOP_P, seed=SEED,
    ))  # fmt: skip
    usage = chunks[-1].usage
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    root, children = _request_spans(spans)
    assert root.name == f"chat {MODEL}" and root.kind is SpanKind.SERVER
    assert usage is not None and usage.prompt_tokens_details is not None
    assert dict(root.attributes or {}) == _expected_attributes(caller, stream=True) | {
        gen_ai.GEN_AI_RESPONSE_ID: chunks[0].id,
        gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: (finish_reasons[-1],),
        gen_ai.GEN_AI_USAGE_INPUT_TOKENS: usage.prompt_tokens,
        gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: usage.completion_tokens,
        gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: usage.prompt_tokens_details.cached_tokens,
    }
    _check_phases(root, children)


def test_refused_chat_span_is_an_admission_error(
    gateway: InProcessGateway, spans: InMemorySpanExporter
) -> None:
    """Refused by admission once its body is read: 60 tokens a minute, the first request
    takes some of them, the second's long prompt does not fit what is left (its tenant
    still had tokens, so the screen before its body let it through)."""
    caller = new_caller(gateway, "traced-refused", "standard",
                        {"tokens_per_minute": 60, "burst_tokens": 60})
    caller.client.chat.completions.create(model=MODEL, messages=_messages("first"), max_tokens=2)
    spans.clear()
    with pytest.raises(openai.RateLimitError):
        caller.client.chat.completions.create(
            model=MODEL, messages=_messages("second " * 60), max_tokens=MAX_TOKENS,
            temperature=TEMPERATURE, top_p=TOP_P, seed=SEED,
        )
    root, children = _request_spans(spans)
    assert set(children) == {"admission"}  # nothing was queued
    assert root.name == f"chat {MODEL}"
    assert root.status.status_code is StatusCode.ERROR
    attributes = dict(root.attributes or {})
    assert attributes["error.type"] == "rate_limit_tokens"
    assert gen_ai.GEN_AI_RESPONSE_ID not in attributes
    assert attributes[gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS] == 0
    assert {k: attributes[k] for k in _expected_attributes(caller, stream=False)} == (
        _expected_attributes(caller, stream=False)
    )
    admission = children["admission"]
    assert admission.status.status_code is StatusCode.ERROR
    assert [event.name for event in admission.events] == ["exception"]


def test_a_chat_refused_before_its_body_is_read_is_traced_without_it(
    gateway: InProcessGateway, spans: InMemorySpanExporter
) -> None:
    """One request a minute: the second is refused by the screen before its body is read,
    so its span knows the operation, tier and tenant but not the model or the sampling."""
    caller = new_caller(gateway, "traced-screened", "standard", ONE_PER_MINUTE)
    caller.client.chat.completions.create(model=MODEL, messages=_messages("first"), max_tokens=2)
    spans.clear()
    with pytest.raises(openai.RateLimitError):
        caller.client.chat.completions.create(
            model=MODEL, messages=_messages("second"), max_tokens=MAX_TOKENS,
            temperature=TEMPERATURE,
        )
    root, children = _request_spans(spans)
    assert set(children) == {"admission"}
    assert root.name == "chat" and root.status.status_code is StatusCode.ERROR
    attributes = dict(root.attributes or {})
    assert attributes["error.type"] == "rate_limit_requests"
    assert gen_ai.GEN_AI_REQUEST_MODEL not in attributes
    assert gen_ai.GEN_AI_REQUEST_TEMPERATURE not in attributes
    assert attributes["tiergate.tenant_id"] == str(caller.tenant_id)
    assert attributes[gen_ai.GEN_AI_OPERATION_NAME] == "chat"
    admission = children["admission"]
    assert admission.status.status_code is StatusCode.ERROR
    assert [event.name for event in admission.events] == ["exception"]


# -- 4. requests refused before admission -------------------------------------------------------


def _revoked_key(gateway: InProcessGateway) -> str:
    tenant_id, key = gateway.create_tenant("revoked", "premium", NEVER_LIMITED)
    with gateway.admin() as admin:
        (listed,) = admin.get(f"/admin/v1/tenants/{tenant_id}/keys").json()["data"]
        assert admin.post(f"/admin/v1/keys/{listed['id']}/revoke").status_code == 200
    return key


def test_requests_refused_before_admission_are_counted_as_invalid(
    gateway: InProcessGateway,
) -> None:
    caller = new_caller(gateway, "invalid-caller", "premium")
    revoked = _revoked_key(gateway)
    ok = {"authorization": f"Bearer {caller.key}"}
    chat = {"model": MODEL, "messages": _messages("hello")}
    base = gateway.base_url
    cases: list[tuple[str, Callable[[], httpx.Response], int]] = [
        ("no key", lambda: httpx.post(f"{base}/v1/chat/completions", json=chat), 401),
        ("unknown key", lambda: httpx.post(
            f"{base}/v1/chat/completions", json=chat, headers={"authorization": "Bearer x"}
        ), 401),
        ("revoked key", lambda: httpx.post(
            f"{base}/v1/completions", json={"model": MODEL, "prompt": "x"},
            headers={"authorization": f"Bearer {revoked}"},
        ), 403),
        ("not JSON", lambda: httpx.post(
            f"{base}/v1/chat/completions", content=b"{", headers=ok
        ), 400),
        ("bad field", lambda: httpx.post(
            f"{base}/v1/chat/completions", json={**chat, "max_tokens": -1}, headers=ok
        ), 400),
        ("unknown model", lambda: httpx.post(
            f"{base}/v1/chat/completions", json={**chat, "model": "gpt-9"}, headers=ok
        ), 404),
        ("unknown route", lambda: httpx.post(
            f"{base}/v1/embeddings", json={"model": MODEL, "input": "x"}, headers=ok
        ), 404),
        ("body too large", lambda: httpx.post(
            f"{base}/v1/chat/completions",
            json={**chat, "messages": _messages("x" * MAX_BODY_BYTES)}, headers=ok,
        ), 413),
        ("models without a key", lambda: httpx.get(f"{base}/v1/models"), 401),
    ]  # fmt: skip
    before = scrape(gateway)
    for name, send, code in cases:
        response = send()
        assert response.status_code == code, (name, response.text)
        assert response.json()["error"]["type"], name  # OpenAI-shaped
        after = scrape(gateway)
        assert requests_increase(before, after) == {(UNKNOWN_TIER, "invalid", code): 1}, name
        before = after

    # Not API requests: admin and unknown top-level routes are not counted.
    before = scrape(gateway)
    assert httpx.get(f"{base}/admin/v1/tenants").status_code == 401
    assert httpx.get(f"{base}/admin/v1/metrics").status_code == 401  # per-tenant figures
    assert "tenant=" not in httpx.get(f"{base}/metrics").text
    assert httpx.get(f"{base}/nothing-here").status_code == 404
    assert requests_increase(before, scrape(gateway)) == {}
    # Counted once: a success, and an admission refusal as refused, never as invalid too.
    throttled = new_caller(gateway, "invalid-throttled", "standard", ONE_PER_MINUTE)
    before = scrape(gateway)
    throttled.client.chat.completions.create(model=MODEL, messages=_messages("a"), max_tokens=2)
    with pytest.raises(openai.RateLimitError):
        throttled.client.chat.completions.create(
            model=MODEL, messages=_messages("b"), max_tokens=2
        )
    expected = Counter({("standard", "completed", 200): 1, ("standard", "refused", 429): 1})
    assert requests_increase(before, settled_scrape(gateway, before, expected)) == expected


def test_the_weight_format_is_on_metrics_and_on_each_record(gateway: InProcessGateway) -> None:
    """The served model's weight format (the engine's label: the fake runner has no weights)
    is an info series on /metrics and the weight_format of the records of the requests that
    ran; a refusal, which ran on nothing, has none."""
    weight_format = gateway.runner.weight_format_label
    assert weight_format == "none"
    text = httpx.get(f"{gateway.base_url}/metrics").text
    assert f'tiergate_model_weight_format{{model="{MODEL}",weight_format="{weight_format}"}} 1.0' \
        in text.splitlines()
    throttled = new_caller(gateway, "weights-throttled", "standard", ONE_PER_MINUTE)
    chat = throttled.client.chat.completions.create(model=MODEL, messages=_messages("a"),
                                                    max_tokens=2)
    with pytest.raises(openai.RateLimitError):
        throttled.client.completions.create(model=MODEL, prompt="b", max_tokens=2)
    deadline_s = time.monotonic() + 30  # the refusal is written with its second's fold
    while len(stored := _records_by_status(gateway, throttled.tenant_id)) < 2:
        assert time.monotonic() < deadline_s, stored
        time.sleep(0.05)
    assert stored["completed"] == (chat.id, weight_format)
    assert stored["refused"][1] is None


def _records_by_status(
    gateway: InProcessGateway, tenant_id: int
) -> dict[str, tuple[str, str | None]]:
    """The tenant's records: status -> (request id, weight format)."""
    with gateway.runtime.session_factory() as session:
        rows = session.execute(
            select(UsageRecordRow.status, UsageRecordRow.request_id,
                   UsageRecordRow.weight_format).where(UsageRecordRow.tenant_id == tenant_id))
        return {str(status): (request_id, fmt) for status, request_id, fmt in rows}


def test_the_event_loop_heartbeat_runs_in_the_served_app(gateway: InProcessGateway) -> None:
    """The app's lifespan started the heartbeat: its lag histogram grows between scrapes
    (one beat due every 10 ms) and its watcher thread runs beside the server."""
    name = "tiergate_event_loop_lag_seconds_count"
    before = scrape(gateway)[name, frozenset()]
    time.sleep(0.2)
    assert scrape(gateway)[name, frozenset()] > before
    assert "tiergate-loop-watch" in {thread.name for thread in threading.enumerate()}
