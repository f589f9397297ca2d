"""Export the gateway's traces over OTLP/HTTP, hand-encoded as protobuf.

OTLP/HTTP for the gateway's traces (tracing.py): recorded spans encoded straight into an
`ExportTraceServiceRequest` (protobuf wire format of opentelemetry/proto/trace/v1/trace.proto,
the fields below) and POSTed to the collector (`application/x-protobuf`). Hand-encoded: the
SDK's way (a ReadableSpan per span, then its encoder's message objects) cost the export
thread several times this (benchmarks/gateway/tracing.py; docs/observability.md). A failed
POST drops its batch (counted by the caller): traces never hold the gateway up."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

import httpx

KINDS = {"internal": 1, "server": 2, "client": 3}  # Span.SpanKind
_FIXED64 = struct.Struct("<Q")
_DOUBLE = struct.Struct("<d")
_KEYS: dict[str, bytes] = {}  # attribute key -> its encoded KeyValue.key field
# (key, value) -> its encoded KeyValue, for the values that repeat (status codes, addresses,
# outcomes); never for the keys whose values do not, and no more than _MAX_CACHED
_KVS: dict[tuple[str, Any], bytes] = {}
_MAX_CACHED = 4096
UNIQUE = frozenset({"epd.request_id", "epd.item", "error.message"})
# Span.flags (fixed32, field 16): sampled, and whether the parent is remote (bits 8, 9)
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", 0x101)
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", 0x301)
_ERROR = b"\x7a\x02\x18\x02"  # status {code: STATUS_CODE_ERROR}


_SMALL = [bytes((i,)) for i in range(0x80)]  # one-byte varints


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (`tag`: its encoded key)."""
    n = len(payload)
    return tag + (_SMALL[n] if n < 0x80 else _varint(n)) + payload


def _value(v: Any) -> bytes:
    """An AnyValue: bool, int (int64), float (double), else a string."""
    if v is True or v is False:
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int):
        return b"\x18" + _varint(v & 0xFFFFFFFFFFFFFFFF)
    if isinstance(v, float):
        return b"\x21" + _DOUBLE.pack(v)
    return _field(b"\x0a", str(v).encode())


def attributes(attrs: dict[str, Any] | None, tag: bytes = b"\x4a") -> bytes:
    """Repeated KeyValue fields (`tag`: Span.attributes, or Resource.attributes)."""
    if not attrs:
        return b""
    out = []
    for k, v in attrs.items():
        kv = _KVS.get((k, v))
        if kv is None:
            key = _KEYS.get(k)
            if key is None:
                key = _KEYS[k] = _field(b"\x0a", k.encode())
            value = _field(b"\x0a", v.encode()) if v.__class__ is str else _value(v)
            kv = key + _field(b"\x12", value)
            if k not in UNIQUE and len(_KVS) < _MAX_CACHED and v.__class__ is not float:
                _KVS[(k, v)] = kv
        out.append(_field(tag, kv))
    return b"".join(out)


def span(trace_id: bytes, span_id: int, parent: int | None, remote_parent: bool, name: str,
         kind: str, start_ns: int, end_ns: int, attrs: dict[str, Any] | None, error: bool,
         tracestate: bytes = b"") -> bytes:
    """One Span message (`trace_id`: 16 bytes; `tracestate`: its encoded field or b"")."""
    body = [b"\x0a\x10", trace_id, b"\x12\x08", span_id.to_bytes(8, "big"), tracestate]
    if parent is not None:
        body += (b"\x22\x08", parent.to_bytes(8, "big"))
    body += (_field(b"\x2a", name.encode()), b"\x30", _varint(KINDS[kind]),
             b"\x39", _FIXED64.pack(start_ns), b"\x41", _FIXED64.pack(end_ns),
             attributes(attrs))
    if error:
        body.append(_ERROR)
    body.append(_FLAGS_REMOTE if remote_parent else _FLAGS_LOCAL)
    return b"".join(body)


def tracestate_field(tracestate: str | None) -> bytes:
    return _field(b"\x1a", tracestate.encode()) if tracestate else b""


def request(resource: bytes, scope: bytes, spans: Iterable[bytes]) -> bytes:
    """Encode an ExportTraceServiceRequest of one resource and scope.

    An ExportTraceServiceRequest of one resource and scope (`resource`, `scope`: their
    encoded messages, from `resource_of`, `scope_of`)."""
    blob = b"".join(b"\x12" + _varint(len(s)) + s for s in spans)  # ScopeSpans.spans
    scope_spans = _field(b"\x0a", scope) + blob
    resource_spans = _field(b"\x0a", resource) + _field(b"\x12", scope_spans)
    return _field(b"\x0a", resource_spans)


def resource_of(attrs: dict[str, Any]) -> bytes:
    return attributes(attrs, b"\x0a")


def scope_of(name: str, version: str = "") -> bytes:
    return _field(b"\x0a", name.encode()) + (_field(b"\x12", version.encode())
                                             if version else b"")


class OtlpHttp:
    """POSTs encoded requests to an OTLP/HTTP traces endpoint (one connection, kept)."""

    def __init__(self, endpoint: str, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint
        self.client = httpx.Client(timeout=timeout_s, trust_env=False, headers={
            "content-type": "application/x-protobuf"})
        self.last_error = ""

    def post(self, body: bytes) -> bool:
        try:
            r = self.client.post(self.endpoint, content=body)
        except httpx.HTTPError as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            return False
        if r.status_code // 100 != 2:
            self.last_error = f"HTTP {r.status_code}: {r.text[:200]}"
            return False
        return True

    def close(self) -> None:
        self.client.close()
