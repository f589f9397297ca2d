"""Prefill/decode instances: least-loaded choice, one retry before the first byte.

`DecodePool.open` sends the request and returns once the response headers arrived (the
first byte): a connect error, a timeout before headers or a 5xx is retried once on another
instance (when there is one). After that the response belongs to the caller, who must
`release()` it (closes the upstream connection: an unfinished request is aborted upstream).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import httpx

from encoder_service.gateway.config import GatewayConfig
from encoder_service.gateway.errors import GatewayError


@dataclass
class Upstream:
    response: httpx.Response
    url: str
    retries: int
    sent_at: float
    pool: DecodePool

    async def release(self) -> None:
        try:
            await self.response.aclose()
        finally:
            self.pool.inflight[self.url] -= 1


class DecodePool:
    def __init__(self, cfg: GatewayConfig, client: httpx.AsyncClient) -> None:
        self.urls = list(cfg.decoders)
        self.client = client
        self.inflight = {u: 0 for u in self.urls}
        t = cfg.timeouts
        self.timeout = httpx.Timeout(connect=t.connect_s, read=t.decode_s, write=t.decode_s,
                                     pool=t.connect_s)
        self.cooldown_s = cfg.cooldown_s
        self.down_until = {u: 0.0 for u in self.urls}
        self._rr = itertools.count()

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
            req = self.client.build_request(method, url + path, content=content,
                                            headers=headers, timeout=self.timeout)
            self.inflight[url] += 1
            sent = time.perf_counter()
            try:
                resp = await self.client.send(req, stream=True)
            except httpx.TimeoutException:
                self._failed(url)
                last_error = f"{url}: no response within the deadline"
                continue
            except httpx.HTTPError as exc:
                self._failed(url)
                last_error = f"{url}: {type(exc).__name__}: {exc}"
                continue
            except BaseException:
                self.inflight[url] -= 1
                raise
            up = Upstream(resp, url, attempt, sent, self)
            if resp.status_code >= 500 and attempt == 0 and len(self.urls) > 1:
                last_error = f"{url}: HTTP {resp.status_code}"
                await up.release()
                self.down_until[url] = time.monotonic() + self.cooldown_s
                continue
            return up
        raise GatewayError(502, f"no prefill/decode instance answered ({last_error})",
                           "decode_unavailable")
