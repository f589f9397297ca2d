"""Traces (encoder_service/gateway/telemetry/tracing.py) through a real gateway in front of stub
upstreams (stubs.py), exported over OTLP/HTTP to a receiver on loopback
(epd_testkit/trace_sink.py): one trace per request with a span per stage and the right
parents, a caller's traceparent continued, `traceparent` sent to the encoder and the decode
instance (the span ids of the calls that carried it); off by default: no traceparent, no
tracer, nothing of OpenTelemetry imported."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ec_connectors.protocol.keys import content_item_id
from encoder_service.gateway.telemetry.tracing import _parse_traceparent
from encoder_service.gateway.upstreams.availability import SafetensorsAvailability
from encoder_service.local.requests import chat_body, sample_image_png
from epd_testkit.trace_sink import TraceSink
from tests.encoder_service.gateway.stubs import MODEL, Lab, metric, post
from tests.helpers import ROOT, port_block, wait_for

LAB = Lab(port_block(__name__))
ROOT_SPAN = "POST /v1/chat/completions"


@pytest.fixture(scope="module")
def sink():
    s = TraceSink(LAB.port())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def traced(sink, tmp_path_factory):
    """Stubs and a traced gateway (export every 50 ms) that follows a directory for items
    already stored (hits)."""
    store = tmp_path_factory.mktemp("store")
    enc, dec = LAB.stub("encoder"), LAB.stub("decoder")
    g = LAB.gateway([enc.url], [dec.url], routing={"probe_interval_s": 0, "overlap": "off"},
                    availability={"kind": "safetensors", "storage_path": str(store)},
                    tracing={"otlp_traces_endpoint": sink.url, "export_interval_s": 0.05})
    yield enc, dec, g, store
    g.stop()
    enc.stop()
    dec.stop()


def trace_of(sink: TraceSink, root_pred, n_spans: int) -> dict[str, dict]:
    """The spans (by name; `epd.item` spans under `epd.item#k`) of the one trace whose root
    span satisfies `root_pred`, once it has `n_spans` of the gateway's spans."""
    def found(spans):
        roots = [s for s in spans if s["name"] == ROOT_SPAN and root_pred(s)]
        return roots and sum(s["trace_id"] == roots[0]["trace_id"] and s["service"] ==
                             "epd-gateway" for s in spans) >= n_spans
    spans = sink.wait_for(found)
    root = next(s for s in spans if s["name"] == ROOT_SPAN and root_pred(s))
    out: dict[str, dict] = {}
    for s in spans:
        if s["trace_id"] == root["trace_id"]:
            name = s["name"]
            k = 0
            while name in out:
                k += 1
                name = f"{s['name']}#{k}"
            out[name] = s
    return out


def rid_is(rid: str):
    return lambda s: s["attributes"].get("epd.request_id") == rid


def test_one_trace_per_request_with_a_span_per_stage(traced, sink):
    enc, dec, g, _ = traced
    image = sample_image_png(301)
    body = {**chat_body(MODEL, image, "x"), "stream": True}
    with httpx.stream("POST", g.url + "/v1/chat/completions", json=body, timeout=10,
                      headers={"x-request-id": "tr-1"}) as r:
        assert r.status_code == 200
        r.read()
    spans = trace_of(sink, rid_is("tr-1"), 8)
    names = set(spans)
    assert {ROOT_SPAN, "epd.parse", "epd.items", "epd.item", "epd.encoder_call",
            "epd.decode", "epd.first_token", "epd.stream"} <= names, names
    root = spans[ROOT_SPAN]
    assert root["parent_id"] == "" and root["kind"] == "server"
    assert root["attributes"]["http.response.status_code"] == 200
    rid = root["trace_id"]
    assert all(s["trace_id"] == rid for s in spans.values())
    for child in ("epd.parse", "epd.items", "epd.decode"):
        assert spans[child]["parent_id"] == root["span_id"], child
    for child in ("epd.item", "epd.encoder_call"):
        assert spans[child]["parent_id"] == spans["epd.items"]["span_id"], child
    for child in ("epd.first_token", "epd.stream"):
        assert spans[child]["parent_id"] == spans["epd.decode"]["span_id"], child
    item = spans["epd.item"]["attributes"]
    assert item["epd.outcome"] == "encoded" and item["epd.encoder"] == enc.url
    assert item["epd.item"] == content_item_id(image, MODEL)
    assert spans["epd.encoder_call"]["kind"] == "client"
    assert spans["epd.decode"]["attributes"]["server.address"] == dec.url
    # time order: parse, then the items, then the decode request; first token before stream
    assert spans["epd.parse"]["end_ns"] <= spans["epd.items"]["start_ns"]
    assert spans["epd.items"]["end_ns"] <= spans["epd.decode"]["start_ns"]
    assert spans["epd.first_token"]["end_ns"] <= spans["epd.stream"]["start_ns"]
    assert root["start_ns"] <= spans["epd.parse"]["start_ns"]
    assert spans["epd.stream"]["end_ns"] <= root["end_ns"]
    # the upstreams got the trace: the encoder the call's span, the decoder the decode span
    enc_tp = _parse_traceparent(enc.headers[-1]["traceparent"].encode())
    dec_tp = _parse_traceparent(dec.headers[-1]["traceparent"].encode())
    assert enc_tp == (int(rid, 16), int(spans["epd.encoder_call"]["span_id"], 16), True)
    assert dec_tp == (int(rid, 16), int(spans["epd.decode"]["span_id"], 16), True)


def test_a_callers_traceparent_is_continued(traced, sink):
    enc, dec, g, _ = traced
    trace_id, caller = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = post(g, chat_body(MODEL, sample_image_png(302), "x"),
             headers={"traceparent": f"00-{trace_id}-{caller}-01", "tracestate": "k=v"})
    assert r.status_code == 200
    spans = trace_of(sink, lambda s: s["trace_id"] == trace_id, 6)
    assert spans[ROOT_SPAN]["parent_id"] == caller
    assert dec.headers[-1]["traceparent"].startswith(f"00-{trace_id}-")
    assert dec.headers[-1]["traceparent"].split("-")[2] == spans["epd.decode"]["span_id"]
    assert dec.headers[-1]["tracestate"] == "k=v"
    assert enc.headers[-1]["traceparent"].startswith(f"00-{trace_id}-")


def test_an_unsampled_caller_is_passed_on_unrecorded(traced, sink):
    enc, dec, g, _ = traced
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4736"
    r = post(g, chat_body(MODEL, sample_image_png(303), "x"),
             headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-00"})
    assert r.status_code == 200
    tp = dec.headers[-1]["traceparent"]
    assert tp.startswith(f"00-{trace_id}-") and tp.endswith("-00")
    # a later traced request is exported; the unsampled one never is
    post(g, chat_body(MODEL, sample_image_png(304), "x"))
    sink.wait_for(lambda spans: len({s["trace_id"] for s in spans if s["name"] == ROOT_SPAN})
                  >= 3)
    assert not [s for s in sink.snapshot() if s["trace_id"] == trace_id]


def test_item_outcomes_hit_and_shared(traced, sink):
    enc, dec, g, store = traced
    hit = sample_image_png(305)
    path = Path(SafetensorsAvailability(store, MODEL).path_for(content_item_id(hit, MODEL)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")  # "already stored": the gateway skips its encode
    r = post(g, chat_body(MODEL, hit, "x"), headers={"traceparent": f"00-{'1' * 32}-"
                                                                      f"{'2' * 16}-01"})
    assert r.status_code == 200
    spans = trace_of(sink, lambda s: s["trace_id"] == "1" * 32, 5)
    assert spans["epd.item"]["attributes"]["epd.outcome"] == "hit"
    assert "epd.encoder_call" not in spans
    # two requests for one new image at once: one encode, the other request shares it
    shared = sample_image_png(306)
    enc.delay = 0.3
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda k: post(g, chat_body(MODEL, shared, "x"), headers={
                "traceparent": f"00-{str(k) * 32}-{'2' * 16}-01"}), (3, 4)))
    finally:
        enc.delay = 0.0
    assert all(a.status_code == 200 for a in answers)
    outcomes = sorted(trace_of(sink, lambda s, k=k: s["trace_id"] == str(k) * 32, 5)
                      ["epd.item"]["attributes"]["epd.outcome"] for k in (3, 4))
    assert outcomes == ["encoded", "shared"]


def test_a_failed_encode_shows_as_errors_and_a_fallback_item(traced, sink):
    enc, dec, g, _ = traced
    enc.fail = True
    try:
        r = post(g, chat_body(MODEL, sample_image_png(311), "x"),
                 headers={"traceparent": f"00-{'8' * 32}-{'2' * 16}-01"})
    finally:
        enc.fail = False
    assert r.status_code == 200  # raw media: the decode instance encodes it
    spans = trace_of(sink, lambda s: s["trace_id"] == "8" * 32, 9)
    calls = [s for k, s in spans.items() if k.startswith("epd.encoder_call")]
    assert len(calls) == 2  # a 500 from the only encoder: asked once more
    assert all(c["status"] == 2 and c["attributes"]["http.response.status_code"] == 500
               for c in calls)
    assert spans["epd.item"]["attributes"]["epd.outcome"] == "fallback"
    assert spans[ROOT_SPAN]["attributes"]["epd.fallback"] == 1
    assert spans[ROOT_SPAN]["status"] == 0  # the request itself went well


def test_overlap_the_decode_request_goes_out_beside_the_items(sink):
    enc, dec = LAB.stub("encoder"), LAB.stub("decoder")
    g = LAB.gateway([enc.url], [dec.url], routing={"probe_interval_s": 0, "overlap": "on"},
                    tracing={"otlp_traces_endpoint": sink.url, "export_interval_s": 0.05})
    enc.delay = 0.2
    try:
        r = post(g, chat_body(MODEL, sample_image_png(312), "x"),
                 headers={"traceparent": f"00-{'9' * 32}-{'2' * 16}-01"})
        assert r.status_code == 200
        spans = trace_of(sink, lambda s: s["trace_id"] == "9" * 32, 8)
        assert spans["epd.decode"]["start_ns"] < spans["epd.items"]["end_ns"]
        assert spans["epd.items"]["attributes"]["epd.overlap"] is True
        assert spans["epd.decode"]["parent_id"] == spans[ROOT_SPAN]["span_id"]
        assert dec.headers[-1]["traceparent"].split("-")[2] == spans["epd.decode"]["span_id"]
        assert enc.headers[-1]["traceparent"].split("-")[2] == \
            spans["epd.encoder_call"]["span_id"]
    finally:
        g.stop()
        enc.stop()
        dec.stop()


def test_exported_spans_are_counted_and_a_collector_that_is_down_costs_no_request(traced):
    _, _, g, _ = traced
    assert post(g, chat_body(MODEL, sample_image_png(308), "x")).status_code == 200  # alone too
    # generous deadlines: the exporter's thread runs late on a loaded machine
    assert wait_for(lambda: metric(g, 'epd_gateway_trace_spans_total{outcome="exported"}') > 0,
                    timeout=30)
    enc, dec = LAB.stub("encoder"), LAB.stub("decoder")
    nobody = f"http://127.0.0.1:{LAB.port()}/v1/traces"  # nothing listens there
    down = LAB.gateway([enc.url], [dec.url], tracing={"otlp_traces_endpoint": nobody,
                                                      "export_interval_s": 0.05})
    try:
        for seed in (309, 310):
            assert post(down, chat_body(MODEL, sample_image_png(seed), "x")).status_code == 200
        assert wait_for(lambda: metric(down, 'epd_gateway_trace_spans_total{outcome="failed"}')
                        >= 16, timeout=30)
    finally:
        down.stop()
        enc.stop()
        dec.stop()


def test_epd_prefill_hop_has_its_own_span(sink):
    enc, dec, pre = LAB.stub("encoder"), LAB.stub("decoder"), LAB.stub("prefill")
    g = LAB.gateway([enc.url], [dec.url], prefills=[pre.url],
                    tracing={"otlp_traces_endpoint": sink.url, "export_interval_s": 0.05})
    try:
        r = post(g, chat_body(MODEL, sample_image_png(308), "x"),
                 headers={"traceparent": f"00-{'7' * 32}-{'2' * 16}-01"})
        assert r.status_code == 200
        spans = trace_of(sink, lambda s: s["trace_id"] == "7" * 32, 7)
        root = spans[ROOT_SPAN]["span_id"]
        assert spans["epd.prefill"]["parent_id"] == root
        assert spans["epd.decode"]["parent_id"] == root
        assert spans["epd.prefill"]["end_ns"] <= spans["epd.decode"]["start_ns"]
        assert spans["epd.prefill"]["attributes"]["epd.kv_handoff"] == "ok"
        assert pre.headers[-1]["traceparent"].split("-")[2] == spans["epd.prefill"]["span_id"]
        assert dec.headers[-1]["traceparent"].split("-")[2] == spans["epd.decode"]["span_id"]
    finally:
        g.stop()
        for s in (enc, dec, pre):
            s.stop()


def test_off_by_default_no_traceparent_no_tracer(sink):
    enc, dec = LAB.stub("encoder"), LAB.stub("decoder")
    g = LAB.gateway([enc.url], [dec.url])
    try:
        assert g.gateway.tracer is None and g.gateway.flow.tracer is None
        r = post(g, chat_body(MODEL, sample_image_png(307), "x"),
                 headers={"traceparent": f"00-{'6' * 32}-{'2' * 16}-01"})
        assert r.status_code == 200
        assert "traceparent" not in enc.headers[-1] and "traceparent" not in dec.headers[-1]
    finally:
        g.stop()
        enc.stop()
        dec.stop()


def test_off_imports_nothing_of_opentelemetry():
    code = ("import asyncio, sys\n"
            "from encoder_service.gateway.app import create_app\n"
            "from encoder_service.gateway.config import GatewayConfig\n"
            "app = create_app(GatewayConfig.build({'decoders': ['http://127.0.0.1:9']}))\n"
            "async def main():\n"
            "    await app.gateway.startup()\n"
            "    await app.gateway.shutdown()\n"
            "asyncio.run(main())\n"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("value, parsed", [
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
     (0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, True)),
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
     (0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, False)),
    (b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future",
     (0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, True)),
    (b"00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),  # zero trace id
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),
    (b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
    (b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x", None),
    (b"00-xyz-00f067aa0ba902b7-01", None),
    (b"garbage", None),
])
def test_traceparent_parsing(value, parsed):
    assert _parse_traceparent(value) == parsed
