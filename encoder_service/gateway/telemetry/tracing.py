"""Traces of chat requests (OpenTelemetry, W3C trace context).

Traces of chat requests (OpenTelemetry, W3C trace context), off unless
`tracing.otlp_traces_endpoint` is set (config.py `TracingConfig`).

On, each POST /v1/chat/completions gets a trace, or continues the caller's (`traceparent`):

  POST /v1/chat/completions   server: arrival to the last byte (status, item counts)
    epd.parse                 body read, media checked and hashed (parsing.py)
    epd.items                 waiting for the items: lookups and encodes (`epd.overlap`)
      epd.item                one per item: `epd.outcome` hit | encoded | shared |
                              fallback, `epd.encoder`
      epd.encoder_call        client, one per call (coalesced: in the trace of the request
                              that opened it); its traceparent -> the encoder's vLLM spans
    epd.prefill               client (E/P/D): traceparent -> the prefill instance's spans
    epd.decode                client: the decode request, sent to its last byte;
                              traceparent -> the decode instance's vLLM spans
      epd.first_token         sent -> the first answer bytes
      epd.stream              the first answer bytes -> the end of the answer

Cost: a span here is a tuple (perf_counter times, ids from `random.getrandbits`) in its
request's list, a finished trace one deque append; one thread of its own encodes them as
OTLP protobuf and POSTs them (otlp.py) every `export_interval_s`, sooner once 2048 wait;
a queue past `max_queued_spans` drops (counted), a failed POST drops its batch. Not the
OpenTelemetry SDK's tracer: its sampler, context and attribute checks and its batch
processor's lock cost the event loop several times this per span, and its exporter more on
top (benchmarks/gateway/tracing.py; the figures in docs/observability.md).
Off: no tracer, no thread; chat.py holds None for the request's trace (one `is None` per
stage) and an upstream call reads one ContextVar (`inject`, `call`).
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

from starlette.types import Message, Scope, Send

from encoder_service.gateway.config import TracingConfig
from encoder_service.gateway.telemetry import otlp
from encoder_service.gateway.telemetry.metrics import GatewayMetrics

logger = logging.getLogger("epd.gateway")

BATCH = 2048  # spans per OTLP request
# the request's log fields (chat.py `info`) its root span carries, when not 0 or absent
_ROOT_FIELDS = ("fallback", "enc_retries", "metadata_only", "failover")
_MASK64 = (1 << 64) - 1
# (the request's trace, the span an upstream call made now is a child of)
_ACTIVE: ContextVar[tuple[RequestTrace, int] | None] = ContextVar("epd_trace", default=None)


def active() -> tuple[RequestTrace, int] | None:
    """The trace and span upstream calls made in this context join (None: not traced)."""
    return _ACTIVE.get()


def activate(value: tuple[RequestTrace, int] | None) -> None:
    """Make `value` (from `active()` elsewhere) this context's (coalesced encoder calls)."""
    _ACTIVE.set(value)


def inject(headers: dict[str, str]) -> None:
    """Add this context's `traceparent` (and `tracestate`) to an upstream call's headers."""
    act = _ACTIVE.get()
    if act is not None:
        act[0].inject(headers, act[1])


def call(name: str, headers: dict[str, str], attrs: dict[str, Any]) -> Call | None:
    """Open a span for an upstream call and put its traceparent in the headers.

    A span for an upstream call made now (a child of this context's span), its
    traceparent put in `headers`; None when nothing is traced here."""
    act = _ACTIVE.get()
    if act is None:
        return None
    trace, parent = act
    span = Call(trace, name, parent, attrs)
    trace.inject(headers, span.span_id)
    return span


def _parse_traceparent(value: bytes) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C traceparent; None when malformed."""
    parts = value.split(b"-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == b"ff" or len(parts[1]) != 32 \
            or len(parts[2]) != 16 or len(parts[3]) != 2 or (parts[0] == b"00" and len(parts) != 4):
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(flags & 1)


class Call:
    """A span open until `done()` (an upstream call: encoder, prefill, decode)."""

    __slots__ = ("trace", "name", "span_id", "parent", "start", "attrs", "open")

    def __init__(self, trace: RequestTrace, name: str, parent: int,
                 attrs: dict[str, Any]) -> None:
        self.trace, self.name, self.parent, self.attrs = trace, name, parent, attrs
        self.span_id = trace.new_id()
        self.start = time.perf_counter()
        self.open = True

    def done(self, error: str = "", end: float | None = None, **attrs: Any) -> None:
        if not self.open:
            return
        self.open = False
        if attrs:
            self.attrs.update(attrs)
        if error:
            self.attrs["error.message"] = error[:300]
        self.trace.add(self.name, self.start, time.perf_counter() if end is None else end,
                       self.parent, self.attrs, "client", bool(error), self.span_id)

    def failed(self, exc: BaseException) -> None:
        attrs: dict[str, Any] = {"error.type": type(exc).__name__}
        status = getattr(exc, "status", None)  # EncoderFailed: the encoder's answer
        if isinstance(status, int):
            attrs["http.response.status_code"] = status
        self.done(str(exc) or type(exc).__name__, **attrs)


# one recorded span: name, span id, parent id (None: the root without a caller), kind,
# start and end (perf_counter seconds), attributes, error
Span = tuple[str, int, int | None, str, float, float, dict[str, Any] | None, bool]
# a finished trace as queued for export: trace id, perf_counter -> epoch offset (ns),
# tracestate, the root's id when its parent is the caller's (remote; else 0), the spans.
# Plain tuples: nothing of the request stays alive in the queue, and the garbage collector
# stops tracking them after its first pass (queued RequestTraces, kept alive for up to
# `export_interval_s`, cost the gateway GC time: docs/benchmarks.md).
Finished = tuple[int, int, str | None, int, tuple[Span, ...]]


class RequestTrace:
    """One request's spans.

    `start` activates its root span in the caller's context; `finish()` (once, at the request's
    end) hands the spans to the exporter."""

    __slots__ = ("tracer", "start", "offset_ns", "tracestate", "trace_id", "parent", "sampled",
                 "_prefix", "_flags", "root", "spans", "status", "attrs", "decode", "_relay",
                 "_done")

    def __init__(self, tracer: Tracer, scope: Scope) -> None:
        self.tracer = tracer
        self.start = time.perf_counter()
        self.offset_ns = time.time_ns() - int(self.start * 1e9)  # perf_counter -> epoch
        tp = ts = None
        for k, v in scope.get("headers", ()):
            if k == b"traceparent":
                tp = v
            elif k == b"tracestate":
                ts = v
        parsed = _parse_traceparent(tp) if tp else None
        self.tracestate = ts.decode("latin-1") if ts and parsed else None
        if parsed is not None:  # the caller's trace, and its decision
            self.trace_id, self.parent, self.sampled = parsed
        else:
            self.trace_id = random.getrandbits(128) or 1
            self.parent = None
            self.sampled = (self.trace_id & _MASK64) < tracer.bound
        self._prefix = f"00-{self.trace_id:032x}-"
        self._flags = "-01" if self.sampled else "-00"
        self.root = self.new_id()
        self.spans: list[Span] = []
        self.status = 0
        self.attrs: dict[str, Any] = {"http.request.method": "POST",
                                      "url.path": scope.get("path", "")}
        self.decode: Call | None = None
        self._relay: tuple[float, float | None, float] | None = None
        self._done = False

    # -- ids and propagation -----------------------------------------------------------------
    @staticmethod
    def new_id() -> int:
        return random.getrandbits(64) or 1

    def inject(self, headers: dict[str, str], span_id: int) -> None:
        headers["traceparent"] = f"{self._prefix}{span_id:016x}{self._flags}"
        if self.tracestate:
            headers["tracestate"] = self.tracestate

    def watch(self, send: Send) -> Send:
        """`send` that notes the response status (the root span's)."""
        async def traced(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
            await send(message)
        return traced

    # -- spans -------------------------------------------------------------------------------
    def add(self, name: str, start: float, end: float, parent: int | None = None,
            attrs: dict[str, Any] | None = None, kind: str = "internal", error: bool = False,
            span_id: int | None = None) -> int:
        """Record a finished span (perf_counter times; parent: the root by default)."""
        sid = self.new_id() if span_id is None else span_id
        if self.sampled:
            self.spans.append((name, sid, self.root if parent is None else parent, kind,
                               start, end, attrs, error))
        return sid

    def begin_items(self) -> int:
        """The `epd.items` span's id, active from now on (encoder calls are its children)."""
        sid = self.new_id()
        _ACTIVE.set((self, sid))
        return sid

    def items(self, span_id: int, start: float, items: Iterable[Any], hits: set[str],
              outcome: Any = None, made_by: Callable[[str], str | None] | None = None,
              overlap: bool = False) -> None:
        """Record the `epd.items` span and one `epd.item` span per item.

        The `epd.items` span and one `epd.item` per item (`outcome`: the router's
        EncodeOutcome for the items not hit; its `landed` times end their spans)."""
        end = time.perf_counter()
        _ACTIVE.set((self, self.root))
        landed = (outcome.landed if outcome is not None else None) or {}
        shared = set(outcome.shared_ids) if outcome is not None else set()
        n = 0
        for it in items:
            n += 1
            item_id = it.item_id
            attrs: dict[str, Any] = {"epd.item": item_id, "epd.modality": it.modality}
            if item_id in hits:
                attrs["epd.outcome"] = "hit"
            elif outcome is not None and item_id in outcome.hints:
                attrs["epd.outcome"] = "shared" if item_id in shared else "encoded"
                encoder = made_by(item_id) if made_by is not None else None
                if encoder:
                    attrs["epd.encoder"] = encoder
            else:
                attrs["epd.outcome"] = "fallback"
            self.add("epd.item", start, landed.get(item_id, end), span_id, attrs)
        self.add("epd.items", start, end, None, {"epd.items": n, "epd.hits": len(hits),
                                                 "epd.overlap": overlap}, span_id=span_id)

    def open_call(self, name: str) -> Call:
        """Open the span of a request to an instance, active in this context.

        The span of a request to an instance (a child of the root; E/P/D: `epd.prefill`),
        active from now on in this context (its traceparent goes along)."""
        span = Call(self, name, self.root, {})
        _ACTIVE.set((self, span.span_id))
        return span

    def open_decode(self) -> Call:
        """Open the decode span, ending any decode span still open.

        `open_call("epd.decode")`, ended with the answer (`finish`); a decode span still
        open (an early request dropped, a metadata-only one asked again raw) ends here."""
        if self.decode is not None:
            self.decode.done(**{"epd.superseded": True})
        self.decode = self.open_call("epd.decode")
        return self.decode

    def decoding(self) -> None:
        """The decode span active in this context (failover legs are its children)."""
        if self.decode is not None:
            _ACTIVE.set((self, self.decode.span_id))

    def relayed(self, sent_at: float, first: float | None, url: str,
                info: dict[str, Any]) -> None:
        """The answer went through: first-token and stream times, the final instance."""
        self._relay = (sent_at, first, time.perf_counter())
        if self.decode is not None:
            self.decode.attrs["server.address"] = url
        for k in _ROOT_FIELDS:  # what the item spans do not tell, when it happened
            v = info.get(k)
            if v:
                self.attrs[f"epd.{k}"] = v

    def finish(self) -> None:
        """End the request's trace (every path, once) and hand it to the exporter."""
        if self._done:
            return
        self._done = True
        end = time.perf_counter()
        decode, relay = self.decode, self._relay
        if relay is not None and decode is not None:
            sent_at, first, relay_end = relay
            if first is not None:
                self.add("epd.first_token", sent_at, first, decode.span_id)
                self.add("epd.stream", first, relay_end, decode.span_id)
            decode.done(end=relay_end)
        elif decode is not None:
            decode.done(f"no answer relayed (HTTP {self.status})" if self.status >= 400
                        else "")
        if self.status:
            self.attrs["http.response.status_code"] = self.status
        else:  # the client went away before an answer
            self.attrs["epd.no_response"] = True
        if self.sampled:
            self.spans.append(("POST /v1/chat/completions", self.root, self.parent, "server",
                               self.start, end, self.attrs, self.status >= 500))
            self.tracer.put((self.trace_id, self.offset_ns, self.tracestate,
                             self.root if self.parent is not None else 0, tuple(self.spans)))
        self.decode = None  # no cycle (the span refers to this trace) for the GC to find
        _ACTIVE.set(None)


class Tracer:
    """A gateway's tracer: starts request traces and exports finished ones.

    A gateway's traces: `start(scope)` per request; a thread exports the finished ones
    (`thread=False`: only `flush()` does, for benchmarks)."""

    def __init__(self, cfg: TracingConfig, metrics: GatewayMetrics | None = None,
                 thread: bool = True) -> None:
        self.cfg = cfg
        counter = metrics.trace_spans if metrics is not None else None
        self._counted = ({k: counter.labels(k) for k in ("exported", "dropped", "failed")}
                         if counter is not None else {})
        self.bound = int(cfg.sample_ratio * (1 << 64))
        self._queue: collections.deque[Finished] = collections.deque()
        self._lock = threading.Lock()
        self._queued = 0  # spans in the queue
        self.dropped = 0  # spans dropped: the queue was full (the collector too slow, gone)
        self.exported = 0
        self.failed = 0  # spans whose export failed
        self._wake = threading.Event()
        self._stopping = False
        self._resource = otlp.resource_of({"service.name": cfg.service_name,
                                           "telemetry.sdk.language": "python"})
        self._scope = otlp.scope_of("epd.gateway")
        self._http = otlp.OtlpHttp(cfg.otlp_traces_endpoint)
        self._warned = 0.0  # when a failed export was last logged
        self._thread = threading.Thread(target=self._run, name="epd-trace-export", daemon=True)
        if thread:
            self._thread.start()

    def start(self, scope: Scope) -> RequestTrace:
        trace = RequestTrace(self, scope)
        _ACTIVE.set((trace, trace.root))
        return trace

    def put(self, trace: Finished) -> None:
        n = len(trace[4])
        with self._lock:
            if self._queued + n > self.cfg.max_queued_spans:
                self.dropped += n
                self._count("dropped", n)
                return
            self._queued += n
            self._queue.append(trace)
            full = self._queued >= BATCH
        if full:
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.cfg.export_interval_s)
            self._wake.clear()
            self.flush()
            if self._stopping:
                return

    def flush(self) -> None:
        """Export what is queued (on the export thread, or at close)."""
        while self._queue:
            traces: list[Finished] = []
            n = 0
            with self._lock:
                while self._queue and n < BATCH:
                    trace = self._queue.popleft()
                    traces.append(trace)
                    n += len(trace[4])
                self._queued -= n
            if self._send(traces):
                self.exported += n
                self._count("exported", n)
            else:
                self.failed += n
                self._count("failed", n)
                if time.monotonic() - self._warned > 60:
                    self._warned = time.monotonic()
                    logger.warning("trace export to %s failed (%s); %d spans dropped so far",
                                   self.cfg.otlp_traces_endpoint, self._http.last_error,
                                   self.failed)

    def _count(self, outcome: str, n: int) -> None:
        if self._counted:
            self._counted[outcome].inc(n)

    def _send(self, traces: list[Finished]) -> bool:
        """One OTLP/HTTP request of `traces`' spans (otlp.py)."""
        spans = []
        for trace_id, off, tracestate, remote_root, recorded in traces:
            tid = trace_id.to_bytes(16, "big")
            state = otlp.tracestate_field(tracestate)
            for name, sid, parent, kind, start, end, attrs, error in recorded:
                spans.append(otlp.span(tid, sid, parent, sid == remote_root, name, kind,
                                       int(start * 1e9) + off, int(end * 1e9) + off,
                                       attrs, error, state))
        return self._http.post(otlp.request(self._resource, self._scope, spans))

    def close(self, timeout_s: float = 5.0) -> None:
        """Export what is left (within `timeout_s`) and stop."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        else:
            self.flush()
        self._http.close()


def make_tracer(cfg: TracingConfig, metrics: GatewayMetrics | None = None) -> Tracer | None:
    """Make the gateway's tracer, or None when tracing is off.

    The gateway's Tracer (its spans counted in `metrics`), or None when tracing is off (no
    endpoint configured)."""
    return None if cfg.otlp_traces_endpoint is None else Tracer(cfg, metrics)
