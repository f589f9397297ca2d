"""Prefill/decode instances: least-loaded choice, one retry before the first byte.

`DecodePool.open` sends the request and returns once the response headers arrived (the
first byte): a connect error, a timeout before headers or a 5xx is retried once on another
instance (when there is one). After that the response belongs to the caller, who must
`release()` it (closes the upstream connection unless the body was read to the end: an
unfinished request is aborted upstream).

This hop uses aiohttp (a vLLM dependency) rather than httpx: it sits on every request's
path and measured about 0.45 ms less per request here (see benchmarks/serve_bench.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp

from encoder_service.gateway.config import GatewayConfig
from encoder_service.gateway.errors import GatewayError


class UpstreamError(Exception):
    """The decode instance's connection broke or stalled after the first byte."""


@dataclass
class Upstream:
    response: aiohttp.ClientResponse
    url: str
    retries: int
    sent_at: float
    pool: DecodePool
    _done: bool = False

    @property
    def status_code(self) -> int:
        return self.response.status

    @property
    def content_type(self) -> str | None:
        return self.response.headers.get("content-type")

    async def read(self) -> bytes:
        try:
            data = await self.response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        self._done = True
        return data

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        self._done = True

    async def release(self) -> None:
        if self._done:
            self.response.release()  # keep-alive connection back to the pool
        else:
            self.response.close()  # drop the connection: the upstream request is aborted
        self.pool.inflight[self.url] -= 1


class DecodePool:
    """Call `start()` inside the running event loop, `close()` at shutdown."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.urls = list(cfg.decoders)
        self.inflight = {u: 0 for u in self.urls}
        t = cfg.timeouts
        self.timeout = aiohttp.ClientTimeout(total=None, connect=t.connect_s,
                                             sock_read=t.decode_s)
        self.cooldown_s = cfg.cooldown_s
        self.down_until = {u: 0.0 for u in self.urls}
        self._rr = itertools.count()
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, ttl_dns_cache=60),
            timeout=self.timeout, auto_decompress=False, trust_env=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def order(self, exclude: set[str] = frozenset(), start: int = 0) -> list[str]:
        """Instances to try, best first: not cooling down after a failure, least in flight,
        ties rotating from `start`."""
        now = time.monotonic()
        n = len(self.urls)
        cands = [(self.down_until[u] > now, self.inflight[u], (i - start) % n, u)
                 for i, u in enumerate(self.urls) if u not in exclude]
        return [u for *_, u in sorted(cands)]

    def _failed(self, url: str) -> None:
        self.inflight[url] -= 1
        self.down_until[url] = time.monotonic() + self.cooldown_s

    async def open(self, method: str, path: str, content: bytes | None,
                   request_id: str) -> Upstream:
        assert self.session is not None, "DecodePool.start() was not called"
        tried: set[str] = set()
        last_error = ""
        start = next(self._rr)
        for attempt in range(2):
            cands = self.order(exclude=tried, start=start)
            if not cands:
                break
            url = cands[0]
            tried.add(url)
            headers = {"x-request-id": f"{request_id}-dec{attempt}"}
            if content is not None:
                headers["content-type"] = "application/json"
            self.inflight[url] += 1
            sent = time.perf_counter()
            try:
                resp = await self.session.request(method, url + path, data=content,
                                                  headers=headers)
            except asyncio.TimeoutError:
                self._failed(url)
                last_error = f"{url}: no response within the deadline"
                continue
            except aiohttp.ClientError as exc:
                self._failed(url)
                last_error = f"{url}: {type(exc).__name__}: {exc}"
                continue
            except BaseException:
                self.inflight[url] -= 1
                raise
            up = Upstream(resp, url, attempt, sent, self)
            if resp.status >= 500 and attempt == 0 and len(self.urls) > 1:
                last_error = f"{url}: HTTP {resp.status}"
                await up.release()
                self.down_until[url] = time.monotonic() + self.cooldown_s
                continue
            return up
        raise GatewayError(502, f"no prefill/decode instance answered ({last_error})",
                           "decode_unavailable")
