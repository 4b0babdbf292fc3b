"""OpenTelemetry: a span per request after the GenAI semantic conventions, and the GenAI
server metrics. Exported over OTLP/HTTP only when an endpoint is configured; by default the
tracer and meter are no-ops and nothing leaves the process.

A request's span is named ``{gen_ai.operation.name} {gen_ai.request.model}`` and has four
children: ``admission`` (the admission decision), ``queue`` (handed to the engine until first
scheduled), ``prefill`` (first scheduled until the first token) and ``decode`` (first token
until the end). Marks take engine-clock times (time.monotonic seconds, as in
engine.RequestMetrics) or default to now.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.metrics import Histogram, Meter, NoOpMeter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import NoOpTracer, Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.util.types import AttributeValue

# Checked in this order; the second is the standard variable every OTel SDK reads.
OTLP_ENDPOINT_ENVS = ("TIERGATE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
INSTRUMENTATION_NAME = "tiergate.gateway"
PROVIDER_NAME = "tiergate"  # gen_ai.provider.name: the model is served by this process
# Bucket advice of the GenAI semantic conventions for the server metrics.
_TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0)  # fmt: skip
_TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                       20.48, 40.96, 81.92)  # fmt: skip


@dataclass(frozen=True)
class TelemetrySettings:
    """Where (and whether) traces and metrics are exported."""

    otlp_endpoint: str | None = None  # OTLP/HTTP base URL, e.g. http://collector:4318
    service_name: str = "tiergate"
    service_instance_id: str | None = None  # the replica's name
    metric_export_interval_s: float = 60.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TelemetrySettings:
        env = os.environ if environ is None else environ
        endpoint = next((env[name] for name in OTLP_ENDPOINT_ENVS if env.get(name)), None)
        return cls(otlp_endpoint=endpoint, service_name=env.get("OTEL_SERVICE_NAME", "tiergate"))


@dataclass(frozen=True)
class GenAiRequest:
    """The request attributes a span starts with."""

    operation: str  # gen_ai.operation.name: "chat" or "text_completion"
    # The model the client asked for; None when the request was refused before its body was
    # read (the span is then named by its operation alone, as the conventions say).
    request_model: str | None
    tier: str
    tenant_id: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    num_choices: int = 1  # the request's n
    is_stream: bool = False


@dataclass(frozen=True)
class GenAiResponse:
    """What the span and the metrics record once the request has ended."""

    response_id: str | None  # the id sent to the client (chatcmpl-...); None if none was
    response_model: str | None
    finish_reasons: Sequence[str]  # one per choice
    num_input_tokens: int
    num_output_tokens: int  # over all choices
    num_cached_input_tokens: int = 0  # of num_input_tokens, served from the prefix cache
    error_type: str | None = None  # error.type when the request failed (e.g. "engine_error")


class _ServerMetrics:
    def __init__(self, meter: Meter) -> None:
        self.ttft: Histogram = meter.create_histogram(
            "gen_ai.server.time_to_first_token",
            unit="s",
            description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS_S,
        )
        self.tpot: Histogram = meter.create_histogram(
            "gen_ai.server.time_per_output_token",
            unit="s",
            description="Time per output token generated after the first token.",
            explicit_bucket_boundaries_advisory=_TPOT_BUCKETS_S,
        )
        self.duration: Histogram = meter.create_histogram(
            "gen_ai.server.request.duration",
            unit="s",
            description="Generative AI server request duration, to the last output token.",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS_S,
        )


class Telemetry:
    """The tracer and meter of one gateway, and their providers (None when not exporting)."""

    def __init__(
        self,
        tracer_provider: TracerProvider | None,
        meter_provider: MeterProvider | None,
    ) -> None:
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self.tracer: Tracer = (
            tracer_provider.get_tracer(INSTRUMENTATION_NAME) if tracer_provider else NoOpTracer()
        )
        self.meter: Meter = (
            meter_provider.get_meter(INSTRUMENTATION_NAME)
            if meter_provider
            else NoOpMeter(INSTRUMENTATION_NAME)
        )
        self._metrics = _ServerMetrics(self.meter)

    @property
    def is_exporting(self) -> bool:
        return self._tracer_provider is not None or self._meter_provider is not None

    def start_request(self, request: GenAiRequest, start_s: float | None = None) -> RequestTrace:
        """Open the request's span at start_s (engine clock seconds; default now)."""
        return RequestTrace(self.tracer, self._metrics, request, start_s)

    def shutdown(self) -> None:
        """Flush what is buffered and stop the exporters."""
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
        if self._meter_provider is not None:
            self._meter_provider.shutdown()


def setup_telemetry(
    settings: TelemetrySettings,
    *,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
) -> Telemetry:
    """Providers exporting to settings.otlp_endpoint and/or the given exporter and reader
    (tests pass in-memory ones); with none of them, a no-op Telemetry.

    The providers are not made global: several gateways (and tests) can live in one process.
    """
    span_processors: list[SimpleSpanProcessor | BatchSpanProcessor] = []
    metric_readers: list[MetricReader] = []
    if settings.otlp_endpoint:
        base = settings.otlp_endpoint.rstrip("/")
        span_processors.append(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{base}/v1/traces")))
        metric_readers.append(
            PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=f"{base}/v1/metrics"),
                export_interval_millis=settings.metric_export_interval_s * 1000,
            )
        )
    if span_exporter is not None:
        span_processors.append(SimpleSpanProcessor(span_exporter))
    if metric_reader is not None:
        metric_readers.append(metric_reader)
    attributes: dict[str, AttributeValue] = {"service.name": settings.service_name}
    if settings.service_instance_id:
        attributes["service.instance.id"] = settings.service_instance_id
    resource = Resource.create(attributes)
    tracer_provider = None
    if span_processors:
        tracer_provider = TracerProvider(resource=resource)
        for processor in span_processors:
            tracer_provider.add_span_processor(processor)
    meter_provider = (
        MeterProvider(resource=resource, metric_readers=metric_readers) if metric_readers else None
    )
    return Telemetry(tracer_provider, meter_provider)


class RequestTrace:
    """The span of one request and its phase children; the gateway marks the phases."""

    def __init__(
        self,
        tracer: Tracer,
        metrics: _ServerMetrics,
        request: GenAiRequest,
        start_s: float | None,
    ) -> None:
        self._tracer = tracer
        self._metrics = metrics
        self._request = request
        # Engine-clock (monotonic) seconds -> epoch nanoseconds, fixed for the request.
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()
        self._start_s = time.monotonic() if start_s is None else start_s
        self._queued_s: float | None = None
        self._scheduled_s: float | None = None
        self._first_token_s: float | None = None
        self._is_finished = False
        name = request.operation
        if request.request_model is not None:
            name = f"{name} {request.request_model}"
        self.span: Span = tracer.start_span(
            name,
            kind=SpanKind.SERVER,
            start_time=self._epoch_ns(self._start_s),
            attributes=_request_attributes(request),
        )

    @contextmanager
    def admission(self) -> Iterator[Span]:
        """Wraps the admission decision; a refusal raised inside marks the span as an error.
        Timed on the engine clock like every other span of the request (the SDK's default,
        the wall clock, can run a few ns ahead of it and end admission after the queue
        span starts)."""
        span = self._tracer.start_span(
            "admission",
            context=trace.set_span_in_context(self.span),
            start_time=self._epoch_ns(time.monotonic()),
        )
        try:
            with trace.use_span(
                span, end_on_exit=False, record_exception=True, set_status_on_exception=True
            ):
                yield span
        finally:
            span.end(end_time=self._epoch_ns(time.monotonic()))

    def admission_refused(self, exc: BaseException, start_s: float) -> None:
        """An admission decision taken from start_s until now, before this trace began,
        refused the request with exc (the screen before the body is read)."""
        span = self._tracer.start_span(
            "admission",
            context=trace.set_span_in_context(self.span),
            start_time=self._epoch_ns(start_s),
        )
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        span.end(end_time=self._epoch_ns(time.monotonic()))

    def queued(self, at_s: float | None = None) -> None:
        """The request was handed to the engine."""
        self._queued_s = self._now(at_s)

    def scheduled(self, at_s: float | None = None) -> None:
        """The engine first scheduled the request: its prefill started."""
        self._scheduled_s = self._now(at_s)
        if self._queued_s is not None:
            self._child("queue", self._queued_s, self._scheduled_s)

    def first_token(self, at_s: float | None = None) -> None:
        """The first output token is out: prefill ends, decode starts."""
        self._first_token_s = self._now(at_s)
        if self._scheduled_s is not None:
            self._child("prefill", self._scheduled_s, self._first_token_s)
        elif self._queued_s is not None:
            # No scheduling time known: the wait and the prefill are one span.
            self._child("queue", self._queued_s, self._first_token_s)

    def finished(self, response: GenAiResponse, at_s: float | None = None) -> None:
        """End the span (once) with the response attributes and record the server metrics."""
        if self._is_finished:
            return
        self._is_finished = True
        end_s = self._now(at_s)
        if self._first_token_s is not None:
            self._child("decode", self._first_token_s, end_s)
        elif self._scheduled_s is not None:
            self._child("prefill", self._scheduled_s, end_s)
        elif self._queued_s is not None:
            self._child("queue", self._queued_s, end_s)
        self.span.set_attributes(_response_attributes(response))
        if response.error_type is not None:
            self.span.set_attribute("error.type", response.error_type)
            self.span.set_status(Status(StatusCode.ERROR, response.error_type))
        self.span.end(end_time=self._epoch_ns(end_s))
        self._record_metrics(response, end_s)

    def _record_metrics(self, response: GenAiResponse, end_s: float) -> None:
        attributes: dict[str, AttributeValue] = {
            "gen_ai.operation.name": self._request.operation,
            "gen_ai.provider.name": PROVIDER_NAME,
            "tiergate.tier": self._request.tier,
        }
        if self._request.request_model is not None:
            attributes["gen_ai.request.model"] = self._request.request_model
        if response.response_model:
            attributes["gen_ai.response.model"] = response.response_model
        if response.error_type is not None:
            attributes["error.type"] = response.error_type
        self._metrics.duration.record(end_s - self._start_s, attributes)
        if response.error_type is not None or self._first_token_s is None:
            return  # TTFT and TPOT are for successful responses only
        self._metrics.ttft.record(self._first_token_s - self._start_s, attributes)
        if response.num_output_tokens > 1:
            tpot_s = (end_s - self._first_token_s) / (response.num_output_tokens - 1)
            self._metrics.tpot.record(tpot_s, attributes)

    def _child(self, name: str, start_s: float, end_s: float) -> None:
        span = self._tracer.start_span(
            name,
            context=trace.set_span_in_context(self.span),
            start_time=self._epoch_ns(start_s),
        )
        span.end(end_time=self._epoch_ns(end_s))

    def _now(self, at_s: float | None) -> float:
        return time.monotonic() if at_s is None else at_s

    def _epoch_ns(self, monotonic_s: float) -> int:
        return round(monotonic_s * 1e9) + self._epoch_offset_ns


def _request_attributes(request: GenAiRequest) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "gen_ai.operation.name": request.operation,
        "gen_ai.provider.name": PROVIDER_NAME,
        "gen_ai.request.stream": request.is_stream,
        "tiergate.tier": request.tier,
        "tiergate.tenant_id": request.tenant_id,
    }
    optional: dict[str, AttributeValue | None] = {
        "gen_ai.request.model": request.request_model,
        "gen_ai.request.max_tokens": request.max_tokens,
        "gen_ai.request.temperature": request.temperature,
        "gen_ai.request.top_p": request.top_p,
        "gen_ai.request.seed": request.seed,
        "gen_ai.request.choice.count": request.num_choices if request.num_choices != 1 else None,
    }
    attributes.update({key: value for key, value in optional.items() if value is not None})
    return attributes


def _response_attributes(response: GenAiResponse) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "gen_ai.response.finish_reasons": list(response.finish_reasons),
        "gen_ai.usage.input_tokens": response.num_input_tokens,
        "gen_ai.usage.output_tokens": response.num_output_tokens,
        "gen_ai.usage.cache_read.input_tokens": response.num_cached_input_tokens,
    }
    if response.response_id:
        attributes["gen_ai.response.id"] = response.response_id
    if response.response_model:
        attributes["gen_ai.response.model"] = response.response_model
    return attributes
