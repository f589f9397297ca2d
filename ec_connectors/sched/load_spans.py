"""The consumer's loads in vLLM's traces (EngineCore process).

When vLLM traces (`vllm serve --otlp-traces-endpoint`: it sets up a tracer provider in this
process and hands the endpoint to it in $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) and a request came
with trace headers (a gateway's `traceparent`: EngineCore's Request keeps them), a request the
connector deferred adds, once it is ready, to that trace:

  epd.connector.wait          first deferral -> ready (a child of the caller's span, beside
                              vLLM's own `llm_request`)
    epd.connector.load        one per item it waited for: load started -> staged on every
                              rank (error: failed); per rank `epd.rank<r>.wait_s` (the
                              Prefetch queued for a loader thread), `.get_s` (read and
                              checksum verified by the transport), `.stage_s` (into the
                              staging area, a device copy included)

Off (no endpoint, or a request without trace headers): `NoSpans`, two no-op calls per
deferred request and per Staged message; nothing of OpenTelemetry is imported."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ec_connectors.control.messages import Staged
from ec_connectors.log import get_logger
from epd_common.lru import BoundedLRU
from scheduler_hooks.item_table import ItemState, ItemTable

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = get_logger(__name__)
_REMEMBERED = 4096  # items whose workers' timings are kept until a request's span reads them


class NoSpans:
    """Tracing off: nothing is recorded."""

    def staged(self, msg: Staged) -> None:
        pass

    def waited(self, request: Request, since: float, now: float,
               item_ids: Iterable[str]) -> None:
        pass


class LoadSpans(NoSpans):
    """Spans of deferred requests' loads (see the module doc).

    `staged` runs on the control channel's thread, `waited` on the scheduler's."""

    def __init__(self, items: ItemTable) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.items = items
        self.tracer = trace.get_tracer("epd.connector")  # vLLM's provider in this process
        self.propagator = TraceContextTextMapPropagator()
        self.set_parent = trace.set_span_in_context
        self.error = trace.Status(trace.StatusCode.ERROR)
        self._lock = threading.Lock()
        self._ranks: BoundedLRU[str, dict[int, tuple[float, float, float]]] = BoundedLRU(
            _REMEMBERED)

    @staticmethod
    def make(items: ItemTable) -> NoSpans:
        """LoadSpans when vLLM traces in this process, else NoSpans."""
        if not os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            return NoSpans()
        try:
            return LoadSpans(items)
        except ImportError as exc:  # vLLM would have failed first; never the connector's end
            logger.warning("EPD: no load spans (%s)", exc)
            return NoSpans()

    def staged(self, msg: Staged) -> None:
        if msg.ok:
            with self._lock:
                ranks = self._ranks.get(msg.item_id)
                if ranks is None:
                    self._ranks[msg.item_id] = ranks = {}
                ranks[msg.rank] = (msg.wait_s, msg.get_s, msg.stage_s)

    def waited(self, request: Request, since: float, now: float,
               item_ids: Iterable[str]) -> None:
        headers = getattr(request, "trace_headers", None)
        if not headers:
            return
        try:
            self._emit(request, headers, since, now, list(item_ids))
        except Exception as exc:  # noqa: BLE001 - a span is never worth a request
            logger.warning("EPD: load span of request %s not recorded: %s",
                           request.request_id, exc)

    def _emit(self, request: Request, headers: Any, since: float, now: float,
              item_ids: list[str]) -> None:
        offset = time.time_ns() - int(time.monotonic() * 1e9)  # monotonic -> epoch ns

        def ns(t: float) -> int:
            return int(t * 1e9) + offset

        parent = self.propagator.extract(headers)
        span = self.tracer.start_span("epd.connector.wait", context=parent,
                                      start_time=ns(since), attributes={
                                          "epd.request_id": request.request_id,
                                          "epd.items": len(item_ids)})
        inner = self.set_parent(span)
        for item_id in item_ids:
            item = self.items.get(item_id)
            attrs: dict[str, Any] = {"epd.item": item_id}
            if item is None:  # placed and gone already, or never loaded here
                continue
            attrs["epd.state"] = item.state.value
            attrs["epd.bytes"] = item.nbytes
            with self._lock:
                ranks = dict(self._ranks.get(item_id) or {})
            for rank, (wait_s, get_s, stage_s) in sorted(ranks.items()):
                attrs[f"epd.rank{rank}.wait_s"] = wait_s
                attrs[f"epd.rank{rank}.get_s"] = get_s
                attrs[f"epd.rank{rank}.stage_s"] = stage_s
            failed = item.state is ItemState.FAILED
            if failed and item.error:
                attrs["error.message"] = item.error[:300]
            load = self.tracer.start_span("epd.connector.load", context=inner,
                                          start_time=ns(item.started), attributes=attrs)
            if failed:
                load.set_status(self.error)
            load.end(end_time=ns(item.deadline if failed else item.ready_at or now))
        span.end(end_time=ns(now))
