"""OpenTelemetry traces of requests: an optional extra (``pip install 'trio-ferry[otel]'``,
``[tracing] enabled = true``); without it nothing here imports OpenTelemetry. One span per
request, ``POST /v1/messages``, a child of the client's ``traceparent`` when it sends a
well-formed one, named back in the answer's own; its children are the phases the handler marks
(:func:`mark`), each a span of its own times::

    admission   arrival ─> queued in the core (body, checks, template, tokens, the key's charge)
    queue       queued ─> the first event (a worker or engine took it)
    engine      the first event ─> the answer complete
    stream      the first byte written ─> the last

The request span carries its id, status, model version, tier and tokens (``gen_ai.usage.*``)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

MARKS = web.RequestKey("trace_marks", dict)  # phase mark -> time.time_ns(), while a request is traced
SPAN: web.RequestKey[Any] = web.RequestKey("trace_span", object)  # an OpenTelemetry span
PHASES = (("admission", "arrival", "admitted"), ("queue", "admitted", "first_event"),
          ("engine", "first_event", "done"), ("stream", "first_byte", "end"))


def mark(request: web.Request, name: str) -> None:
    """Note that the request reached ``name`` now (nothing when it is not traced); the first
    mark of a name counts."""
    marks = request.get(MARKS)
    if marks is not None and name not in marks:
        marks[name] = time.time_ns()


class Tracing:
    """Spans of requests from an OpenTelemetry ``Tracer``."""

    def __init__(self, tracer: Any) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer, self._trace = tracer, trace
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def from_config(cls, enabled: bool, service_name: str, otlp_endpoint: str) -> Tracing | None:
        """The configuration's tracing: spans exported over OTLP/HTTP to ``otlp_endpoint`` (or
        where ``OTEL_EXPORTER_OTLP_ENDPOINT`` says); None when not ``enabled``."""
        if not enabled:
            return None
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise ValueError(
                "tracing: enabled, but OpenTelemetry is not installed (pip install 'trio-ferry[otel]')"
            ) from None
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        exporter = OTLPSpanExporter(endpoint=otlp_endpoint) if otlp_endpoint else OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider.get_tracer("ferry"))

    def begin(self, request: web.Request) -> None:
        """The request's span, from now, under the client's ``traceparent`` if it sent one."""
        parent = self._propagator.extract({"traceparent": request.headers.get("traceparent", "")})
        now = time.time_ns()
        request[SPAN] = self._tracer.start_span(f"{request.method} {request.path}", context=parent,
                                                kind=self._trace.SpanKind.SERVER, start_time=now)
        request[MARKS] = {"arrival": now}

    def end(self, request: web.Request, attributes: dict[str, Any]) -> None:
        """Close the request's span and its phases, with ``attributes`` (the access log's)."""
        span, marks = request[SPAN], request[MARKS]
        marks["end"] = end = time.time_ns()
        context = self._trace.set_span_in_context(span)
        for name, start, stop in PHASES:
            if start in marks and stop in marks:
                child = self._tracer.start_span(name, context=context, start_time=marks[start])
                child.end(end_time=marks[stop])
        span.set_attributes({key: value for key, value in attributes.items() if value is not None})
        if attributes.get("http.response.status_code", 0) >= 500:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))
        span.end(end_time=end)

    async def traceparent(self, request: web.Request, response: web.StreamResponse) -> None:
        """The answer's ``traceparent``: this request's span, for the client to find it by."""
        span = request.get(SPAN)
        if span is not None:
            carrier: dict[str, str] = {}
            self._propagator.inject(carrier, context=self._trace.set_span_in_context(span))
            response.headers.update(carrier)
