"""Health probes that run a real forward on each instance.

Health probes that run a real forward: every `routing.probe_interval_s`, each vLLM
instance (decode instances, vLLM encoders) gets a one-token text completion; a pool encoder
its `/health`. An instance that fails or misses the deadline cools down (tried last, as after
a failed request) until a probe passes again; `GET /instances` shows each one's last probe.
A hung engine behind a live HTTP server (its `/health` may still answer) is found this way
before a client request waits on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class ProbeResult:
    ok: bool
    ms: float
    at: float  # time.time() of the probe
    error: str = ""

    def describe(self) -> dict[str, Any]:
        out = {"ok": self.ok, "ms": round(self.ms, 1), "age_s": round(time.time() - self.at, 1)}
        return {**out, "error": self.error} if self.error else out


class Prober:
    """Probe instances periodically and report each outcome.

    `targets()` -> [(url, kind)], kind "vllm" (a forward) or "pool" (/health);
    `on_result(url, ok)` is told every outcome (the pools cool failed instances down)."""

    def __init__(self, client: httpx.AsyncClient, model: str, interval_s: float,
                 timeout_s: float, targets: Callable[[], list[tuple[str, str]]],
                 on_result: Callable[[str, bool], None]) -> None:
        self.client, self.model = client, model
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.targets, self.on_result = targets, on_result
        self.results: dict[str, ProbeResult] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def probe(self, url: str, kind: str) -> ProbeResult:
        t0 = time.perf_counter()
        try:
            if kind == "pool":
                r = await self.client.get(url + "/health", timeout=self.timeout_s)
            else:
                r = await self.client.post(url + "/v1/completions", timeout=self.timeout_s,
                                           json={"model": self.model, "prompt": "ping",
                                                 "max_tokens": 1, "temperature": 0.0})
            ok, error = r.status_code == 200, "" if r.status_code == 200 else \
                f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"[:200]
        result = ProbeResult(ok, (time.perf_counter() - t0) * 1e3, time.time(), error)
        self.results[url] = result
        self.on_result(url, ok)
        return result

    async def _run(self) -> None:
        while True:
            targets = self.targets()
            await asyncio.gather(*(self.probe(u, k) for u, k in targets))
            for gone in set(self.results) - {u for u, _ in targets}:
                del self.results[gone]
            await asyncio.sleep(self.interval_s)
