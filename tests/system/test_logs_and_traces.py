"""What an operator reads of each request, through the real app and bridge in one process: one
access log line per request (bounded by its rate), JSON log lines that carry the request's id,
and OpenTelemetry spans, read from an in-process exporter: the request's, under the client's
``traceparent`` and named back to it, with its admission, queue, engine and stream phases."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.log_format import JsonLines
from tests.support.harness import CONFIG, ScriptedBackend, headers, in_process, message, run, sse

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def access_lines():
    """The access log's lines as JSON objects, as ``ferry serve --log-format json`` writes them."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(handler.format(record))  # type: ignore[method-assign]
    handler.setFormatter(JsonLines())
    logger = logging.getLogger("ferry.access")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lambda: [json.loads(line) for line in lines]
    logger.removeHandler(handler)


def test_each_request_gets_one_access_line_with_its_id_status_model_and_tokens(access_lines):
    async def body():
        async with in_process(ScriptedBackend()) as (client, _):
            whole = await client.post("/v1/messages", json=message("say:Hel|lo"), headers=headers())
            streamed = await client.post("/v1/messages", json=message("say:a|b", stream=True),
                                         headers=headers())
            await streamed.read()
            refused = await client.post("/v1/messages", json={"model": "scripted"}, headers=headers())
            return [await whole.json(), whole.headers["request-id"], streamed.headers["request-id"],
                    refused.status, refused.headers["request-id"]]

    answer, whole_id, stream_id, refused_status, refused_id = run(body)
    lines = {line["request_id"]: line for line in access_lines()}
    assert set(lines) == {whole_id, stream_id, refused_id} and answer["id"] == whole_id
    line = lines[whole_id]
    assert (line["logger"], line["status"], line["model"], line["tier"], line["outcome"]) == (
        "ferry.access", 200, "scripted@1", "paid", "completed")
    assert (line["output_tokens"], line["cached_tokens"], line["path"]) == (5, 0, "/v1/messages")
    assert line["input_tokens"] > 0 and line["total_ms"] >= line["ttft_ms"] >= 0
    assert lines[stream_id]["output_tokens"] == 2
    assert (refused_status, lines[refused_id]["status"]) == (400, 400) and "model" not in lines[refused_id]
    assert not any("sk-" in json.dumps(line) for line in lines.values())  # never a key


def test_past_its_rate_the_access_log_counts_what_it_did_not_write(access_lines):
    config = CONFIG.replace("[server]\n", "[server]\naccess_log_per_second = 2\n")

    async def body():
        async with in_process(ScriptedBackend(), config) as (client, _):
            for _ in range(6):
                (await client.get("/healthz")).release()

    run(body)
    lines = access_lines()
    assert len(lines) == 2 and all(line["unlogged"] == 0 for line in lines)  # 4 more, counted later


def test_a_request_is_a_span_under_the_client_s_traceparent_with_its_phases():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    async def body():
        async with in_process(ScriptedBackend(), tracer=provider.get_tracer("test")) as (client, _):
            response = await client.post("/v1/messages", json=message("say:Hel|lo", stream=True),
                                         headers={**headers(), "traceparent": PARENT})
            events = sse(await response.read())
            return response.headers, events

    answered, events = run(body)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    request = spans["POST /v1/messages"]
    assert set(spans) == {"POST /v1/messages", "admission", "queue", "engine", "stream"}
    assert f"{request.context.trace_id:032x}" == PARENT.split("-")[1]  # the client's trace
    assert f"{request.parent.span_id:016x}" == PARENT.split("-")[2]
    ours = f"{request.context.span_id:016x}"
    assert answered["traceparent"].split("-")[1:3] == [PARENT.split("-")[1], ours]
    assert all(spans[phase].parent.span_id == request.context.span_id for phase in ("admission", "queue"))
    admission, queue, engine = spans["admission"], spans["queue"], spans["engine"]
    assert request.start_time == admission.start_time <= admission.end_time == queue.start_time
    assert queue.end_time == engine.start_time <= engine.end_time <= request.end_time
    attributes = request.attributes
    assert (attributes["http.response.status_code"], attributes["ferry.model"], attributes["ferry.tier"]) == (
        200, "scripted@1", "paid")
    assert attributes["gen_ai.usage.output_tokens"] == 5
    assert attributes["ferry.request_id"] == answered["request-id"]
    assert events[-1][0] == "message_stop"


def test_json_lines_name_the_request_being_served():
    from gateway.log_format import REQUEST

    record = logging.LogRecord("ferry.gateway", logging.WARNING, __file__, 1, "slow %s", ("worker",), None)
    token = REQUEST.set("msg_abc_1")
    try:
        line = json.loads(JsonLines().format(record))
    finally:
        REQUEST.reset(token)
    assert line | {"time": None} == {"time": None, "level": "WARNING", "logger": "ferry.gateway",
                                     "message": "slow worker", "request_id": "msg_abc_1"}
