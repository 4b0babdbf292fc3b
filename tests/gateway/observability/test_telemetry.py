"""OpenTelemetry: the request span and its phase children carry the GenAI attributes, the
GenAI server metrics are recorded, nothing is exported by default, and OTLP/HTTP export
reaches a collector on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.trace import NoOpTracer, SpanKind, StatusCode

from gateway.observability.telemetry import (
    GenAiRequest,
    GenAiResponse,
    Telemetry,
    TelemetrySettings,
    setup_telemetry,
)
from tests.gateway.loopback_receiver import LoopbackReceiver

REQUEST = GenAiRequest(
    operation="chat",
    request_model="tiny-llama",
    tier="premium",
    tenant_id="42",
    max_tokens=64,
    temperature=0.7,
    top_p=0.9,
    seed=5,
    num_choices=2,
    is_stream=True,
)
RESPONSE = GenAiResponse(
    response_id="chatcmpl-abc123",
    response_model="tiny-llama",
    finish_reasons=("stop", "length"),
    num_input_tokens=120,
    num_output_tokens=33,
    num_cached_input_tokens=96,
)


@pytest.fixture
def recorded() -> Iterator[tuple[Telemetry, InMemorySpanExporter, InMemoryMetricReader]]:
    spans = InMemorySpanExporter()
    reader = InMemoryMetricReader()
    telemetry = setup_telemetry(TelemetrySettings(), span_exporter=spans, metric_reader=reader)
    yield telemetry, spans, reader
    telemetry.shutdown()


def _by_name(spans: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    finished = spans.get_finished_spans()
    by_name = {span.name: span for span in finished}
    assert len(by_name) == len(finished), "one span per name"
    return by_name


def _histograms(reader: InMemoryMetricReader) -> dict[str, list[HistogramDataPoint]]:
    data = reader.get_metrics_data()
    assert data is not None
    return {
        metric.name: [p for p in metric.data.data_points if isinstance(p, HistogramDataPoint)]
        for resource_metrics in data.resource_metrics
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
    }


def test_request_span_and_phases_carry_the_genai_attributes(
    recorded: tuple[Telemetry, InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    telemetry, spans, reader = recorded
    assert telemetry.is_exporting
    t0 = 5000.0  # engine clock seconds
    trace = telemetry.start_request(REQUEST, start_s=t0)
    with trace.admission():
        pass
    trace.queued(t0 + 0.010)
    trace.scheduled(t0 + 0.050)
    trace.first_token(t0 + 0.130)
    trace.finished(RESPONSE, at_s=t0 + 0.770)
    trace.finished(RESPONSE, at_s=t0 + 9.0)  # ignored: a span ends once

    by_name = _by_name(spans)
    assert set(by_name) == {"chat tiny-llama", "admission", "queue", "prefill", "decode"}
    root = by_name["chat tiny-llama"]
    assert root.kind is SpanKind.SERVER
    assert root.parent is None
    assert dict(root.attributes or {}) == {
        gen_ai.GEN_AI_OPERATION_NAME: "chat",
        gen_ai.GEN_AI_PROVIDER_NAME: "tiergate",
        gen_ai.GEN_AI_REQUEST_MODEL: "tiny-llama",
        gen_ai.GEN_AI_REQUEST_MAX_TOKENS: 64,
        gen_ai.GEN_AI_REQUEST_TEMPERATURE: 0.7,
        gen_ai.GEN_AI_REQUEST_TOP_P: 0.9,
        gen_ai.GEN_AI_REQUEST_SEED: 5,
        gen_ai.GEN_AI_REQUEST_CHOICE_COUNT: 2,
        gen_ai.GEN_AI_REQUEST_STREAM: True,
        gen_ai.GEN_AI_RESPONSE_MODEL: "tiny-llama",
        gen_ai.GEN_AI_RESPONSE_ID: "chatcmpl-abc123",
        gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: ("stop", "length"),
        gen_ai.GEN_AI_USAGE_INPUT_TOKENS: 120,
        gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: 33,
        gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: 96,
        "tiergate.tier": "premium",
        "tiergate.tenant_id": "42",
    }
    assert root.status.status_code is StatusCode.UNSET
    for name in ("admission", "queue", "prefill", "decode"):
        child = by_name[name]
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
    # Phases tile the request: queue ends where prefill starts, prefill where decode starts.
    assert root.start_time is not None and root.end_time is not None
    assert root.end_time - root.start_time == 770_000_000
    starts = {name: by_name[name].start_time for name in ("queue", "prefill", "decode")}
    ends = {name: by_name[name].end_time for name in ("queue", "prefill", "decode")}
    assert starts["queue"] == root.start_time + 10_000_000
    assert ends["queue"] == starts["prefill"] == root.start_time + 50_000_000
    assert ends["prefill"] == starts["decode"] == root.start_time + 130_000_000
    assert ends["decode"] == root.end_time

    histograms = _histograms(reader)
    (ttft,) = histograms["gen_ai.server.time_to_first_token"]
    (tpot,) = histograms["gen_ai.server.time_per_output_token"]
    (duration,) = histograms["gen_ai.server.request.duration"]
    assert ttft.count == tpot.count == duration.count == 1
    assert ttft.sum == pytest.approx(0.130)
    assert tpot.sum == pytest.approx(0.640 / 32)
    assert duration.sum == pytest.approx(0.770)
    assert dict(ttft.attributes or {}) == {
        gen_ai.GEN_AI_OPERATION_NAME: "chat",
        gen_ai.GEN_AI_PROVIDER_NAME: "tiergate",
        gen_ai.GEN_AI_REQUEST_MODEL: "tiny-llama",
        gen_ai.GEN_AI_RESPONSE_MODEL: "tiny-llama",
        "tiergate.tier": "premium",
    }
    # The semantic conventions' bucket advice is applied.
    assert list(ttft.explicit_bounds)[:4] == [0.001, 0.005, 0.01, 0.02]


def test_refused_request_marks_the_admission_span_as_an_error(
    recorded: tuple[Telemetry, InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    telemetry, spans, reader = recorded
    trace = telemetry.start_request(REQUEST)
    with pytest.raises(RuntimeError, match="over the tokens-per-minute limit"), trace.admission():
        raise RuntimeError("over the tokens-per-minute limit")
    trace.finished(
        GenAiResponse(None, None, (), num_input_tokens=120, num_output_tokens=0,
                      error_type="rate_limit_exceeded")
    )  # fmt: skip
    by_name = _by_name(spans)
    assert set(by_name) == {"chat tiny-llama", "admission"}
    admission = by_name["admission"]
    assert admission.status.status_code is StatusCode.ERROR
    assert [event.name for event in admission.events] == ["exception"]
    root = by_name["chat tiny-llama"]
    assert root.status.status_code is StatusCode.ERROR
    assert (root.attributes or {})["error.type"] == "rate_limit_exceeded"
    assert gen_ai.GEN_AI_RESPONSE_ID not in (root.attributes or {})
    histograms = _histograms(reader)
    assert set(histograms) == {"gen_ai.server.request.duration"}  # TTFT/TPOT: successes only
    assert dict(histograms["gen_ai.server.request.duration"][0].attributes or {})["error.type"] == (
        "rate_limit_exceeded"
    )


def test_without_a_scheduling_time_the_wait_and_prefill_are_one_queue_span(
    recorded: tuple[Telemetry, InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    telemetry, spans, _ = recorded
    trace = telemetry.start_request(REQUEST, start_s=10.0)
    trace.queued(10.0)
    trace.first_token(10.2)
    trace.finished(RESPONSE, at_s=10.5)
    by_name = _by_name(spans)
    assert set(by_name) == {"chat tiny-llama", "queue", "decode"}
    queue = by_name["queue"]
    assert queue.end_time is not None and queue.start_time is not None
    assert queue.end_time - queue.start_time == 200_000_000


def test_nothing_is_exported_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TIERGATE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    telemetry = setup_telemetry(TelemetrySettings.from_env())
    assert not telemetry.is_exporting
    assert isinstance(telemetry.tracer, NoOpTracer)
    trace = telemetry.start_request(REQUEST)
    assert not trace.span.is_recording()
    with trace.admission():
        trace.queued()
    trace.first_token()
    trace.finished(RESPONSE)
    telemetry.shutdown()


def test_endpoint_from_the_environment() -> None:
    both = {"TIERGATE_OTLP_ENDPOINT": "http://a:4318", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://b"}
    assert TelemetrySettings.from_env(both).otlp_endpoint == "http://a:4318"
    standard = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4318", "OTEL_SERVICE_NAME": "gw"}
    settings = TelemetrySettings.from_env(standard)
    assert (settings.otlp_endpoint, settings.service_name) == ("http://b:4318", "gw")
    assert TelemetrySettings.from_env({}).otlp_endpoint is None


def _attribute(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind)


def test_otlp_http_export_reaches_a_collector() -> None:
    collector = LoopbackReceiver()
    try:
        settings = TelemetrySettings(
            otlp_endpoint=collector.url("/otlp/"), service_instance_id="gw-3"
        )
        telemetry = setup_telemetry(settings)
        trace = telemetry.start_request(REQUEST)
        trace.queued()
        trace.scheduled()
        trace.first_token()
        trace.finished(RESPONSE)
        telemetry.shutdown()  # flushes the batch processor and the metric reader
        traces = collector.posts("/otlp/v1/traces")
        metrics = collector.posts("/otlp/v1/metrics")
    finally:
        collector.close()
    assert traces and metrics
    assert traces[0].headers["content-type"] == "application/x-protobuf"
    spans = []
    for post in traces:
        request = ExportTraceServiceRequest.FromString(post.body)
        for resource_spans in request.resource_spans:
            resource = {a.key: _attribute(a.value) for a in resource_spans.resource.attributes}
            assert resource["service.name"] == "tiergate"
            assert resource["service.instance.id"] == "gw-3"
            for scope_spans in resource_spans.scope_spans:
                spans.extend(scope_spans.spans)
    assert sorted(span.name for span in spans) == [
        "chat tiny-llama",
        "decode",
        "prefill",
        "queue",
    ]
    root = next(span for span in spans if span.name == "chat tiny-llama")
    attributes = {a.key: _attribute(a.value) for a in root.attributes}
    assert attributes[gen_ai.GEN_AI_RESPONSE_ID] == "chatcmpl-abc123"
    assert attributes[gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS] == 33
    names = {
        metric.name
        for post in metrics
        for resource_metrics in ExportMetricsServiceRequest.FromString(post.body).resource_metrics
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
    }
    assert names == {
        "gen_ai.server.time_to_first_token",
        "gen_ai.server.time_per_output_token",
        "gen_ai.server.request.duration",
    }
