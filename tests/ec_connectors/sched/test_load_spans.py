"""The consumer's loads in vLLM's traces (ec_connectors/sched/load_spans.py): off without
vLLM's OTLP endpoint in the environment; on, a deferred request with trace headers gets an
`epd.connector.wait` span under the caller's span and one `epd.connector.load` per item,
with each rank's wait/get/stage times from its Staged report (a failed load: error)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from ec_connectors.control.messages import Staged
from ec_connectors.sched.load_spans import LoadSpans, NoSpans
from scheduler_hooks.item_table import ItemTable

TRACE, CALLER = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def _spans(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    items = ItemTable(5.0, 120.0)
    spans = LoadSpans.make(items)
    assert isinstance(spans, LoadSpans)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans.tracer = provider.get_tracer("test")  # vLLM's global provider in EngineCore
    return spans, items, exporter


def _request(headers):
    return SimpleNamespace(request_id="r1", trace_headers=headers)


def test_off_without_vllms_endpoint(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert type(LoadSpans.make(ItemTable(5.0, 120.0))) is NoSpans


def test_a_deferred_request_gets_a_wait_span_and_one_load_per_item(monkeypatch):
    spans, items, exporter = _spans(monkeypatch)
    t0 = time.monotonic()
    for item in ("a", "b"):
        items.begin(item, t0, 10.0, nbytes=64)
    spans.staged(Staged(item_id="a", rank=0, ok=True, nbytes=64, num_embeds=4,
                        wait_s=0.001, get_s=0.002, stage_s=0.0005))
    items.staged("a", 0, True, 4, "", {0}, t0 + 0.01, 64)
    items.staged("b", 0, False, 0, "checksum mismatch", {0}, t0 + 0.02)
    headers = {"traceparent": f"00-{TRACE}-{CALLER}-01"}
    spans.waited(_request(headers), t0 - 0.001, t0 + 0.03, ["a", "b", "gone"])
    out = {s.name + s.attributes.get("epd.item", ""): s for s in exporter.get_finished_spans()}
    wait, a, b = out["epd.connector.wait"], out["epd.connector.loada"], out["epd.connector.loadb"]
    assert f"{wait.context.trace_id:032x}" == TRACE and f"{wait.parent.span_id:016x}" == CALLER
    assert a.parent.span_id == wait.context.span_id == b.parent.span_id
    assert a.attributes["epd.state"] == "staged" and a.attributes["epd.bytes"] == 64
    assert a.attributes["epd.rank0.get_s"] == 0.002 and a.attributes["epd.rank0.wait_s"] == 0.001
    assert abs((a.end_time - a.start_time) - 10_000_000) < 10_000  # begin -> staged
    assert b.status.status_code is StatusCode.ERROR
    assert b.attributes["error.message"] == "checksum mismatch"
    assert wait.end_time - wait.start_time > 30_000_000 - 10_000
    assert len(out) == 3  # an item no longer in the table has no span


def test_no_trace_headers_no_span(monkeypatch):
    spans, items, exporter = _spans(monkeypatch)
    items.begin("a", 0.0, 10.0)
    spans.waited(_request(None), 0.0, 1.0, ["a"])
    spans.waited(_request({}), 0.0, 1.0, ["a"])
    assert exporter.get_finished_spans() == ()
