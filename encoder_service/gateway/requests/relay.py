"""Relay a decode instance's answer to the client.

Passing a decode instance's answer through to the client: the disconnect watch, the
error answer, and the relay itself (whole or streamed, SSE chunks forwarded as they arrive).

One `Exchange` is the client's side of a request (its ASGI channel, id, start time, endpoint
and watch); one `RelayPlan` what the caller wants on the way (a callback at the first answer
bytes, a failover resumer, whether the client asked for token ids). A client disconnect
cancels the handler (`Watch`), which closes the upstream connection: vLLM aborts the
request. A stream that breaks off is continued on another instance when the plan has a
resumer (resume.py, failover.py); a whole answer that breaks off is asked again elsewhere
(the client has seen nothing)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from encoder_service.gateway.telemetry.log_lines import info_line
from encoder_service.gateway.telemetry.metrics import DECODE, REFUSED, RESUMED, GatewayMetrics
from encoder_service.gateway.telemetry.tracing import RequestTrace
from encoder_service.gateway.upstreams.decoders import Upstream, UpstreamError
from encoder_service.gateway.upstreams.failover import ResumeMismatch, StreamTracker
from encoder_service.gateway.upstreams.resume import Resumed, ResumeFn
from encoder_service.gateway.wire import GatewayError, json_encode, ms

logger = logging.getLogger("epd.gateway")


_WATCH_AFTER_S = 0.05  # how long a request runs before its disconnect watch starts


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Watch:
    """Cancels the handler's task when the client disconnects, until `finish()`.

    One watcher task per request (started after the body was read) covers every await:
    encoding, waiting for the decode instance, relaying. Cancelling the handler closes the
    upstream connections on the way out, which aborts the requests there."""

    def __init__(self, receive: Receive) -> None:
        self.task = asyncio.current_task()
        self.gone = False
        self.active = True
        self.receive = receive
        self.watcher: asyncio.Future | None = None
        # the watcher task starts once the answer takes a while: a quick request costs no
        # task of its own; a disconnect before is seen when it starts (receive() says so)
        self.timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            _WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self.timer = None
        if self.active:
            self.watcher = asyncio.ensure_future(_wait_disconnect(self.receive))
            self.watcher.add_done_callback(self._fired)

    def _fired(self, fut: asyncio.Future) -> None:
        if not self.active or fut.cancelled() or fut.exception() is not None:
            return
        self.gone = True
        if self.task is not None:
            self.task.cancel()

    def finish(self) -> None:
        """Call right before the last send: a disconnect after it is a normal close."""
        self.active = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.watcher is not None:
            self.watcher.cancel()


@dataclass
class Exchange:
    """The client's side of one request, once its body was read and its watch started."""

    scope: Scope
    receive: Receive
    send: Send
    rid: str
    t0: float  # when the request came in (perf_counter)
    endpoint: str  # the metrics label: chat, completions, models
    watch: Watch


@dataclass(frozen=True)
class RelayPlan:
    """How to relay one answer: callbacks, failover and what the client wants.

    `on_first()`: runs once the first answer bytes are in (the decode has prefilled);
    `resume`: continues an answer that broke off on another instance (None: no failover);
    `wants_ids`: the client asked for token ids itself (else they are removed);
    `wants_usage`: a usage chunk ends the stream (`stream_options.include_usage`);
    `trace`: the request's trace (tracing.py), told the first-token and stream times."""

    on_first: Callable[[], None] | None = None
    resume: ResumeFn | None = None
    wants_ids: bool = False
    wants_usage: bool = False
    trace: RequestTrace | None = None


_NO_PLAN = RelayPlan()


@dataclass
class _Leg:
    """The upstream answer being relayed now.

    The upstream answer being relayed now (another one after a failover) and when its
    first bytes arrived."""

    up: Upstream
    first: float | None = None
    sent_at: float = 0.0  # when the first leg was sent: first-token time counts from it
    sent_to: str = ""  # the first leg's instance

    def __post_init__(self) -> None:
        self.sent_at = self.up.sent_at
        self.sent_to = self.up.url


def _broke(up: Upstream, exc: Exception) -> GatewayError:
    return GatewayError(502, f"the prefill/decode instance {up.url} broke off its answer "
                        f"({exc})", "decode_broke")


class Relay:
    """Answers to the client: errors, and decode instances' answers passed through."""

    def __init__(self, metrics: GatewayMetrics, decode_timeout_s: float) -> None:
        self.metrics = metrics
        self.decode_timeout_s = decode_timeout_s
        # labelled children bound on first use: labels() takes a lock on every call
        self._answered: dict[tuple[str, int], Any] = {}  # (endpoint, status) -> counter
        self._first_token: dict[str, Any] = {}  # instance -> histogram

    def error(self, exc: GatewayError, endpoint: str, rid: str) -> JSONResponse:
        """The HTTP answer for `exc` (counted and logged)."""
        self.metrics.requests.labels(endpoint, str(exc.status)).inc()
        if exc.status < 500:
            self.metrics.rejected.labels(exc.reason).inc()
        logger.warning("request rejected rid=%s endpoint=%s status=%d reason=%s message=%r",
                       rid, endpoint, exc.status, exc.reason, exc.message)
        headers = {"x-request-id": rid}
        if exc.retry_after_s is not None:
            headers["retry-after"] = str(max(1, round(exc.retry_after_s)))
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def client_gone(self, rid: str) -> None:
        self.metrics.disconnects.inc()
        logger.info("client disconnected rid=%s; upstream requests cancelled", rid)

    async def guarded(self, answer: Callable[[], Awaitable[None]], ex: Exchange) -> None:
        """Run an upstream answer, turning errors and disconnects into outcomes.

        Run an upstream answer: a GatewayError becomes its HTTP error, a client that went
        away is counted (the upstream call was cancelled with it), the watch always ends."""
        try:
            await answer()
        except GatewayError as exc:
            ex.watch.finish()
            await self.error(exc, ex.endpoint, ex.rid)(ex.scope, ex.receive, ex.send)
        except asyncio.CancelledError:
            if not ex.watch.gone:
                raise
            self.client_gone(ex.rid)
        finally:
            ex.watch.finish()

    async def relay(self, up: Upstream, ex: Exchange, stream: bool, info: dict[str, object],
                    plan: RelayPlan = _NO_PLAN) -> None:
        """Pass an upstream answer through to the client.

        Pass the upstream answer through, closing it on every path (cancelled by the watch
        on a client disconnect: the upstream connection is closed, vLLM aborts the
        request). `info`: the request's log fields (a failover adds its own)."""
        headers = [(b"x-request-id", ex.rid.encode())]
        ctype = up.content_type
        if ctype:
            headers.append((b"content-type", ctype.encode()))
        status = up.status_code
        leg = _Leg(up)
        try:
            if stream:
                status = await self._stream(leg, ex, status, headers, info, plan)
            else:
                await self._whole(leg, ex, status, headers, info, plan)
        except OSError:  # the ASGI server reports a vanished client this way
            ex.watch.finish()
            self.client_gone(ex.rid)
            return
        finally:
            await leg.up.release()
        self._done(leg, ex, status, stream, info)
        if plan.trace is not None:
            plan.trace.relayed(leg.sent_at, leg.first, leg.up.url, info)

    # -- a whole answer ----------------------------------------------------------------------
    async def _whole(self, leg: _Leg, ex: Exchange, status: int,
                     headers: list[tuple[bytes, bytes]], info: dict[str, object],
                     plan: RelayPlan) -> None:
        data = await self._read(leg, ex.rid, info, plan.resume)
        leg.first = time.perf_counter()
        if plan.on_first is not None:
            plan.on_first()
        headers.append((b"content-length", str(len(data)).encode()))
        ex.watch.finish()
        await ex.send({"type": "http.response.start", "status": status, "headers": headers})
        await ex.send({"type": "http.response.body", "body": data})

    async def _read_once(self, up: Upstream) -> bytes:
        try:
            return await up.read(self.decode_timeout_s)
        except TimeoutError:
            raise GatewayError(504, "the prefill/decode instance did not answer in time",
                               "decode_timeout") from None

    async def _read(self, leg: _Leg, rid: str, info: dict[str, object],
                    resume: ResumeFn | None) -> bytes:
        """The whole answer; one that breaks off is asked again elsewhere once."""
        try:
            return await self._read_once(leg.up)
        except UpstreamError as exc:
            self.metrics.upstream_errors.labels(DECODE).inc()
            again = None if resume is None else await resume(None, leg.up.url)
            if again is None:
                raise _broke(leg.up, exc) from None
            self.metrics.failovers.labels(RESUMED).inc()  # the client saw nothing yet
            logger.warning("decode answer broke rid=%s decoder=%s error=%s action=asked %s "
                           "again", rid, leg.up.url, exc, again[0].url)
            await leg.up.release()
            leg.up = again[0]
            info["failover"] = leg.up.url
        try:
            return await self._read_once(leg.up)
        except UpstreamError as exc:
            self.metrics.upstream_errors.labels(DECODE).inc()
            raise _broke(leg.up, exc) from None

    # -- a stream ----------------------------------------------------------------------------
    async def _stream(self, leg: _Leg, ex: Exchange, status: int,
                      headers: list[tuple[bytes, bytes]], info: dict[str, object],
                      plan: RelayPlan) -> int:
        """Relay a stream; returns the status to count (502 when it broke off for good)."""
        await ex.send({"type": "http.response.start", "status": status, "headers": headers})
        tracker = (StreamTracker(plan.wants_ids, plan.wants_usage)
                   if plan.resume is not None else None)
        chunks: AsyncIterator[bytes] = leg.up.chunks().__aiter__()
        while True:
            try:
                await self._pass(leg, chunks, tracker, ex.send, plan.on_first)
                ex.watch.finish()
                await ex.send({"type": "http.response.body", "body": b""})
                return status
            except (UpstreamError, ResumeMismatch) as exc:
                self.metrics.upstream_errors.labels(DECODE).inc()
                if tracker is not None and (tail := tracker.tail()) is not None:
                    await self._complete(leg, ex, exc, tail)  # only the end was lost
                    return status
                again = (await plan.resume(tracker, leg.up.url)
                         if plan.resume is not None and tracker is not None
                         and "failover" not in info else None)
                if again is None:
                    await self._broke_off(leg, ex, exc, tracker is not None)
                    return 502
                assert tracker is not None
                chunks = await self._switch(leg, ex, again, tracker, info, exc)

    @staticmethod
    async def _pass(leg: _Leg, chunks: AsyncIterator[bytes], tracker: StreamTracker | None,
                    send: Send, on_first: Callable[[], None] | None) -> None:
        """Forward the stream's chunks (what the tracker lets through) to its end."""
        async for chunk in chunks:
            if leg.first is None:
                leg.first = time.perf_counter()
                if on_first is not None:
                    on_first()
            if tracker is not None:
                chunk = tracker.feed(chunk)
                if not chunk:
                    continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def _switch(self, leg: _Leg, ex: Exchange, again: Resumed, tracker: StreamTracker,
                      info: dict[str, object], exc: Exception) -> AsyncIterator[bytes]:
        """Go on with the continuation `again` (the tracker was switched to it)."""
        self.metrics.failovers.labels(RESUMED).inc()
        logger.warning("decode stream broke rid=%s decoder=%s error=%s action=resumed on %s "
                       "after %d tokens", ex.rid, leg.up.url, exc, again[0].url,
                       len(tracker.token_ids))
        await leg.up.release()
        leg.up, chunks, head = again
        info["failover"] = leg.up.url  # the resumer set the tracker
        data = tracker.feed(head)
        if data:
            await ex.send({"type": "http.response.body", "body": data, "more_body": True})
        return chunks

    async def _complete(self, leg: _Leg, ex: Exchange, exc: Exception, tail: bytes) -> None:
        """End a stream cleanly that broke after its answer was whole.

        The answer was whole when the stream broke: send what the client still lacks
        (`data: [DONE]`, or nothing when that passed too) and end it cleanly."""
        logger.warning("decode stream broke rid=%s decoder=%s error=%s action=completed "
                       "(the answer had finished)", ex.rid, leg.up.url, exc)
        ex.watch.finish()
        if tail:
            await ex.send({"type": "http.response.body", "body": tail, "more_body": True})
        await ex.send({"type": "http.response.body", "body": b""})

    async def _broke_off(self, leg: _Leg, ex: Exchange, exc: Exception,
                         tracked: bool) -> None:
        """End a stream that cannot go on with an error event: tell, not a silent cut."""
        if tracked:
            self.metrics.failovers.labels(REFUSED).inc()
        ex.watch.finish()
        logger.warning("decode stream broke rid=%s decoder=%s error=%s", ex.rid, leg.up.url,
                       exc)
        err = GatewayError(502, f"the prefill/decode instance broke off the stream ({exc})",
                           "decode_broke").body()
        await ex.send({"type": "http.response.body",
                       "body": b"data: " + json_encode(err) + b"\n\n"})

    def _done(self, leg: _Leg, ex: Exchange, status: int, stream: bool,
              info: dict[str, object]) -> None:
        """Count and log a relayed answer."""
        m, up = self.metrics, leg.up
        total = time.perf_counter() - ex.t0
        if leg.first is not None:
            m.stage_first_token.observe(leg.first - leg.sent_at)
            hist = self._first_token.get(leg.sent_to)
            if hist is None:
                hist = self._first_token[leg.sent_to] = m.instance_first_token.labels(
                    leg.sent_to)
            hist.observe(leg.first - leg.sent_at)
        m.stage_total.observe(total)
        counter = self._answered.get((ex.endpoint, status))
        if counter is None:
            counter = self._answered[ex.endpoint, status] = m.requests.labels(ex.endpoint,
                                                                              str(status))
        counter.inc()
        if logger.isEnabledFor(logging.INFO):
            first = ms(None if leg.first is None else leg.first - leg.sent_at)
            extra = " ".join(f"{k}={v}" for k, v in info.items())
            info_line(logger, f"request rid={ex.rid} endpoint={ex.endpoint} status={status} "
                      f"stream={stream} decoder={up.url} dec_retries={up.retries} {extra} "
                      f"first_token_ms={first} total_ms={ms(total)}")
