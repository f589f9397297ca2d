"""Instances a supervisor reports down and back.

Instances a supervisor reports down and back (`epd up` runs the gateway in its own process
and restarts the servers it started: encoder_service/local/supervise.py).

`down(url)`: the instance's process died; it gets nothing new (routing.Members.down) until it
is back, rather than each request finding out with a failed connection. `back(url)`: its
process was restarted and answers /health; it gets work again once a real forward passes
(probes.Prober: a one-token completion, a pool encoder's /health), tried every
`interval_s` until one does or it is reported down again. Call both on the gateway's event
loop (`GatewayThread.call_soon`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from encoder_service.gateway.upstreams.probes import Prober
from encoder_service.gateway.upstreams.routing import Members

logger = logging.getLogger("epd.gateway")


class Outages:
    """Mark instances down and up as a supervisor reports them.

    `pools`: the upstream pools (decode instances, encoders); `kind(url)`: the probe's
    kind for an instance ("vllm" or "pool")."""

    def __init__(self, pools: list[Members], prober: Prober, kind: Callable[[str], str],
                 interval_s: float = 1.0) -> None:
        self.pools, self.prober, self.kind = pools, prober, kind
        self.interval_s = interval_s
        self._rejoins: dict[str, asyncio.Task] = {}

    def _owners(self, url: str) -> list[Members]:
        return [p for p in self.pools if url in p.down_until]

    def down(self, url: str) -> None:
        self._cancel(url)
        for pool in self._owners(url):
            pool.down.add(url)
        logger.warning("instance down url=%s action=no new work until it is back", url)

    def back(self, url: str) -> None:
        self._cancel(url)
        self._rejoins[url] = asyncio.ensure_future(self._rejoin(url))

    async def _rejoin(self, url: str) -> None:
        tries = 0
        while True:
            tries += 1
            result = await self.prober.probe(url, self.kind(url))
            if result.ok:
                break
            await asyncio.sleep(self.interval_s)
        for pool in self._owners(url):
            pool.down.discard(url)
            pool.cool_down(url, 0)
        self._rejoins.pop(url, None)
        logger.info("instance back url=%s probes=%d probe_ms=%.0f", url, tries, result.ms)

    def _cancel(self, url: str) -> None:
        task = self._rejoins.pop(url, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self._rejoins.values())
        self._rejoins.clear()
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
