"""A minimal in-memory OTLP/HTTP trace receiver.

A minimal OTLP/HTTP trace receiver: `POST /v1/traces` (protobuf, gzip or not), each span
kept in memory as a plain dict. For tests, benchmarks and a quick look at what the gateway
and vLLM send without a collector (`python -m epd_testkit.trace_sink --port 4318`
prints one line per span); not a collector: nothing is stored or forwarded."""

from __future__ import annotations

import argparse
import gzip
import threading
import time
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer",
         5: "consumer"}


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return None if which is None else getattr(v, which)


def decode_spans(body: bytes) -> list[dict[str, Any]]:
    """Decode the spans of an ExportTraceServiceRequest into dicts.

    The spans of one ExportTraceServiceRequest, as dicts: trace_id, span_id, parent_id
    (hex; "" for a root), name, kind, service, start_ns, end_ns, attributes, status
    (0 unset, 1 ok, 2 error), events [(name, time_ns, attributes)]."""
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append({
                    "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                    "parent_id": s.parent_span_id.hex(), "name": s.name,
                    "kind": KINDS.get(s.kind, str(s.kind)),
                    "service": resource.get("service.name", ""), "resource": resource,
                    "scope": ss.scope.name, "start_ns": s.start_time_unix_nano,
                    "end_ns": s.end_time_unix_nano,
                    "attributes": {kv.key: _value(kv.value) for kv in s.attributes},
                    "status": s.status.code,
                    "events": [(e.name, e.time_unix_nano,
                                {kv.key: _value(kv.value) for kv in e.attributes})
                               for e in s.events]})
    return out


class TraceSink:
    """Receive spans over OTLP/HTTP on a thread of its own.

    Receives spans on `host:port` (a thread of its own) until `stop()`; `spans` holds them
    (`on_span`: called with each one as well)."""

    def __init__(self, port: int, host: str = "127.0.0.1",
                 on_span: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.spans: list[dict[str, Any]] = []
        self.requests = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                encoding = (self.headers.get("content-encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                try:
                    spans = decode_spans(body)
                except Exception:  # noqa: BLE001 - not OTLP: refused, the sink goes on
                    self.send_response(400)
                    self.end_headers()
                    return
                with sink._lock:
                    sink.spans.extend(spans)
                    sink.requests += 1
                if on_span is not None:
                    for span in spans:
                        on_span(span)
                data = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{port}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                        name="trace-sink")
        self._thread.start()

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.spans)

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()

    def wait_for(self, pred: Callable[[list[dict[str, Any]]], bool],
                 timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """The spans once `pred(spans)` holds (the last snapshot when `timeout_s` passes)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if pred(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=4318)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--quiet", action="store_true", help="count spans, print nothing")
    a = p.parse_args()

    def show(s: dict[str, Any]) -> None:
        ms = (s["end_ns"] - s["start_ns"]) / 1e6
        print(f"{s['trace_id'][:8]} {s['span_id'][:8]} <- {s['parent_id'][:8] or '-':8} "
              f"{s['service']:<16} {s['name']:<28} {ms:8.2f} ms {s['attributes']}",
              flush=True)

    sink = TraceSink(a.port, a.host, None if a.quiet else show)
    print(f"OTLP/HTTP trace sink on {sink.url}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        sink.stop()


if __name__ == "__main__":
    main()
