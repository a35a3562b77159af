"""OpenTelemetry traces: one trace per request, across processes.

The frontend that takes a request opens its root span (``pagedserve.request``,
until the last token it streams) and stores the span's W3C ``traceparent`` with
the request in Redis. The loop of each executor the request runs on adds, under
that parent, a ``pagedserve.queue`` span (from submission to its first
admission there) and a ``pagedserve.executor`` span (from admission until it
finishes there or leaves), with the request id, the executor and what it did
there as attributes. With ``--otlp-traces-endpoint`` spans go to an OTLP/HTTP
collector; without it tracing is off and costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(slots=True)
class Tracing:
    provider: TracerProvider
    tracer: Tracer

    def shutdown(self) -> None:
        """Flush what is buffered (the service stops)."""
        self.provider.shutdown()


def setup(service: str, endpoint: str | None = None, exporter: SpanExporter | None = None) -> Tracing | None:
    """Tracing to ``endpoint`` (OTLP/HTTP) or ``exporter``; None (off) when neither is given.

    Each component gets its own provider rather than the process-global one, so
    that two components in one process (tests) keep their own exporters.
    """
    if exporter is None and not endpoint:
        return None
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter,
        )

        exporter = OTLPSpanExporter(endpoint=endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider, provider.get_tracer("pagedserve"))


def traceparent(span: trace.Span) -> str:
    """The span's context as a W3C ``traceparent`` header value."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def parent(value: str) -> Context | None:
    """The context a ``traceparent`` value names (None if empty)."""
    return _PROPAGATOR.extract({"traceparent": value}) if value else None
