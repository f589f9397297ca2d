"""Prefill/decode instances: choice, retries and membership.

Prefill/decode instances: affinity choice under bounded load (routing.py), one retry before
the first byte, membership that changes at run time (drained before an instance leaves).

`DecodePool.open` sends the request and returns once the response headers arrived (the
first byte): a refused connection moves on to the next instance at no cost (nothing was
sent), a connection the instance dropped before answering is tried once more on it; a
timeout before headers, a second broken connection or a 5xx is retried once on another
instance (when there is one); a plain 500 from the only eligible instance is asked once more
on it (vLLM answers 500 when its API server's and EngineCore's processor caches drift, and
heals them before answering; encoder calls do the same, encoder_clients.py). After that the
response belongs to the caller, who must `release()` it (closes the upstream connection
unless the body was read to the end: an unfinished request is aborted upstream), on every
path, a cancelled one included: until then the request counts in flight on its instance
(`routing.Hold`, taken off exactly once), which load-aware routing reads.
`failed_before_answer()` tells an answer that failed before its first token (a 5xx, or a
stream whose first event is an error: vLLM streams a role chunk before the engine has run)
from one that has begun.

This hop uses the project's own lean HTTP/1.1 client (http1.py) rather than aiohttp or
httpx: it sits on every request's path (docs/benchmarks.md, gateway hop).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Set
from dataclasses import dataclass, field

from encoder_service.gateway.config import PoolSection
from encoder_service.gateway.telemetry import tracing
from encoder_service.gateway.telemetry.metrics import DECODE, GatewayMetrics
from encoder_service.gateway.upstreams.http1 import (
    ConnectFailed,
    Disconnected,
    Http1Pool,
    HttpError,
    Response,
)
from encoder_service.gateway.upstreams.routing import Chooser, Hold, Members, rendezvous
from encoder_service.gateway.wire import DecodeError, GatewayError, json_decode


class UpstreamError(Exception):
    """The decode instance's connection broke or stalled after the first byte."""


@dataclass
class Upstream:
    response: Response
    url: str
    retries: int
    sent_at: float
    hold: Hold  # counted in flight on its instance until `release()`
    _done: bool = False
    _released: bool = False
    _held: list[bytes] = field(default_factory=list)  # read by failed_before_answer()

    @property
    def status_code(self) -> int:
        return self.response.status

    @property
    def content_type(self) -> str | None:
        return self.response.headers.get("content-type")

    async def read(self, timeout_s: float | None = None) -> bytes:
        """The whole answer, within `timeout_s`; raises UpstreamError or TimeoutError."""
        try:
            data = await self.response.read(timeout_s)
        except HttpError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        self._done = True
        return data

    async def failed_before_answer(self, stream: bool) -> bool:
        """Did the request fail before its first token?

        For a stream, reads (and holds for `chunks()`) the events up to the first that decides
        it."""
        if self.status_code >= 500:
            return True
        if not stream or self.status_code != 200:
            return False
        pending = b""
        try:
            async for chunk in self.response.chunks():
                self._held.append(chunk)
                pending += chunk
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    verdict = _first_event_verdict(event)
                    if verdict is not None:
                        return verdict
        except (HttpError, TimeoutError):
            return not self._held
        self._done = True
        return False

    async def chunks(self) -> AsyncIterator[bytes]:
        held, self._held = self._held, []
        for chunk in held:
            yield chunk
        if self._done:
            return
        try:
            async for chunk in self.response.chunks():
                yield chunk
        except (HttpError, TimeoutError) as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        self._done = True

    async def release(self) -> None:
        self.close()

    def close(self) -> None:
        """Give the upstream connection back and stop counting it in flight.

        Give the connection back (or close it: an unfinished request is aborted upstream)
        and stop counting it in flight; a second call changes nothing."""
        if self._released:
            return
        self._released = True
        # read to the end: the connection goes back to the pool; else it is closed and the
        # upstream request aborted
        self.response.release()
        self.hold.done()


def _first_event_verdict(event: bytes) -> bool | None:
    """Classify one SSE event of a stream: error, answer, or role-only chunk.

    One SSE event of a chat/completions stream: True = an error, False = an answer has
    begun (text, a finish reason, anything unexpected), None = a role-only chunk."""
    if not event.startswith(b"data: ") or event.startswith(b"data: [DONE]"):
        return False
    try:
        body = json_decode(event[6:])
    except DecodeError:
        return False
    if not isinstance(body, dict):
        return False
    if "error" in body:
        return True
    for choice in body.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("finish_reason") or delta.get("content") or choice.get("text"):
            return False
        if set(delta) - {"role", "content"}:  # tool calls, reasoning...: an answer
            return False
    return None if body.get("choices") else False


class DecodePool(Members):
    """The prefill/decode instances a gateway sends requests to.

    Call `start()` inside the running event loop, `close()` at shutdown.

    `metrics`: where `request()` counts a client request's decode failures and retries."""

    def __init__(self, section: PoolSection, metrics: GatewayMetrics | None = None) -> None:
        self.urls = list(section.urls)
        super().__init__(self.urls, section.cooldown_s, {"requests": 0, "affinity": 0})
        self.chooser = Chooser(section.policy, section.load_factor)
        self.role = section.role  # in its errors: "no <role> instance answered"
        self.section = section
        self.session: Http1Pool | None = None
        self.metrics = metrics

    async def start(self) -> None:
        # connections kept alive for less than vLLM's own keep-alive (uvicorn's
        # timeout_keep_alive, VLLM_HTTP_TIMEOUT_KEEP_ALIVE): a request is never sent on one the
        # server is closing
        s = self.section
        self.session = Http1Pool(s.connect_s, s.read_s, keepalive_s=4, headers=s.headers)

    async def close(self) -> None:
        if self.session is not None:
            self.session.close()

    def order(self, key: str | None = None, exclude: Set[str] = frozenset()) -> list[str]:
        """The instances to try for a request, best first.

        Instances to try, best first: the policy's order for `key` (the request's first
        item; None: least loaded) among those not cooling down after a failure, then those
        cooling down. Draining and down instances get nothing new."""
        now = time.monotonic()
        live = [u for u in self.urls if u not in exclude and self.usable(u)]
        up = [u for u in live if self.down_until[u] <= now]
        cooling = [u for u in live if self.down_until[u] > now]
        return (self.chooser.order(key, up, self.inflight)
                + self.chooser.order(key, cooling, self.inflight))

    # -- membership --------------------------------------------------------------------------
    def names(self) -> list[str]:
        return self.urls

    def add(self, url: str) -> None:
        if url not in self.urls:
            self.urls.append(url)
        self._join(url)

    def _forget(self, url: str) -> None:
        with contextlib.suppress(ValueError):
            self.urls.remove(url)
        if self.session is not None:  # its kept-alive connections, closed now
            self.session.forget(url)

    def _failed(self, hold: Hold) -> None:
        hold.done()
        self.cool_down(hold.name)

    def _again(self, key: str | None, tried: set[str], url: str, status: int) -> bool:
        """Whether a first attempt's 5xx is retried, and where.

        Whether a first attempt's 5xx from `url` is tried once more: on another instance
        (`url` cools down), or, a plain 500, on `url` itself once no other answers (`open`:
        it is up, and vLLM heals the processor-cache drift behind such a 500 first)."""
        if self.order(key, tried):
            self.cool_down(url)
            return True
        return status == 500

    async def open(self, method: str, path: str, content: bytes | None,
                   request_id: str, key: str | None = None,
                   exclude: Set[str] = frozenset()) -> Upstream:
        """Open a request on the best instance, retrying once before the first byte.

        `key`: what the request's affinity follows (its first item id), None for none;
        `exclude`: instances not to use (one that just broke off this answer)."""
        assert self.session is not None, "DecodePool.start() was not called"
        tried: set[str] = set(exclude)
        last_error = ""
        preferred = rendezvous(key, self.urls)[0] if key is not None and self.urls else ""
        answered = 0  # attempts the instance may have seen: a 5xx, a timeout, a break
        attempt = -1
        # a refused connection sent nothing: it costs no retry, so every instance is tried
        # once before a 502 (two killed at once must not spend both of a request's tries)
        sick = ""  # the instance of a plain 500: asked once more when no other answers
        dropped: set[str] = set()  # instances that dropped a connection before answering
        while answered < 2 and attempt < 2 * len(self.urls) + 1:
            cands = self.order(key, exclude=tried)
            if not cands and sick:  # none other (left): the 500's own instance once more
                tried.discard(sick)
                cands, sick = self.order(key, exclude=tried), ""
            if not cands:
                break
            attempt += 1
            url = cands[0]
            tried.add(url)
            self.counts[url]["requests"] += 1
            self.counts[url]["affinity"] += url == preferred
            headers = {"x-request-id": f"{request_id}-dec{attempt}"}
            if content is not None:
                headers["content-type"] = "application/json"
            tracing.inject(headers)  # traced: the instance's vLLM spans join the trace
            hold = self.hold(url)  # taken off exactly once: here on failure, or at release()
            sent = time.perf_counter()
            try:
                resp = await self.session.request(method, url, path, content, headers)
            except TimeoutError:
                self._failed(hold)
                last_error = f"{url}: no response within the deadline"
                answered += 1
                continue
            except ConnectFailed as exc:
                self._failed(hold)
                last_error = f"{url}: {type(exc).__name__}: {exc}"
                continue
            except Disconnected as exc:
                last_error = f"{url}: {type(exc).__name__}: {exc}"
                if url not in dropped:  # the instance closed the connection as we sent on
                    dropped.add(url)    # it (a kept-alive one it had just timed out): once
                    tried.discard(url)  # more on a new connection, at no cost
                    hold.done()
                    continue
                self._failed(hold)
                answered += 1
                continue
            except HttpError as exc:
                self._failed(hold)
                last_error = f"{url}: {type(exc).__name__}: {exc}"
                answered += 1
                continue
            except BaseException:
                hold.done()
                raise
            up = Upstream(resp, url, attempt, sent, hold)
            if resp.status == 401:  # not the client's fault: never relayed as its own 401
                last_error = (f"{url}: refused the gateway's API key (401); give the gateway "
                              "and the servers the same deployment secret")
                await up.release()
                self.cool_down(url)
                continue
            if resp.status >= 500 and answered == 0 and self._again(key, tried, url,
                                                                    resp.status):
                last_error = f"{url}: HTTP {resp.status}"
                answered += 1
                sick = url if resp.status == 500 else ""
                await up.release()
                continue
            return up
        raise GatewayError(502, f"no {self.role} instance answered ({last_error})",
                           "decode_unavailable")

    async def request(self, method: str, path: str, content: bytes | None, request_id: str,
                      key: str | None = None) -> Upstream:
        """Open a client's request, counting its failures and retries.

        `open()` for a client's request, its failures and retries counted in the metrics
        (a failover's opens are not: the relay counts the break that caused them)."""
        m = self.metrics
        try:
            up = await self.open(method, path, content, request_id, key=key)
        except GatewayError:
            if m is not None:
                m.upstream_errors.labels(DECODE).inc()
            raise
        if up.retries and m is not None:
            m.retries.labels(DECODE).inc(up.retries)
            m.upstream_errors.labels(DECODE).inc(up.retries)
        return up
