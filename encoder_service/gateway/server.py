"""Run the gateway, blocking or on a background thread.

Run the gateway: `serve` (blocking, for `epd gateway`), `GatewayThread` (in-process, for
`epd up`, tests and benchmarks), and `ScalingPort`: what `epd up`'s scaler (local/scaler.py)
may do to an in-process gateway."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import uvicorn

from encoder_service.gateway.app import create_app
from encoder_service.gateway.config import GatewayConfig
from encoder_service.gateway.telemetry.log_lines import setup_logging


def _uvicorn_config(cfg: GatewayConfig, app=None) -> uvicorn.Config:
    return uvicorn.Config(app or create_app(cfg), host=cfg.host, port=cfg.port,
                          log_level="warning", access_log=False, lifespan="on",
                          timeout_graceful_shutdown=5)


def serve(cfg: GatewayConfig) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn's own handlers: graceful, 5 s cap)."""
    setup_logging(cfg.log_level)
    uvicorn.Server(_uvicorn_config(cfg)).run()


class GatewayThread:
    """The gateway on a background thread with its own event loop.

    `start()` returns once it accepts connections (or raises); `stop()` shuts it down
    gracefully; `call_soon(fn, *args)` runs `fn` on its loop, from any thread (`epd up`'s
    supervisor: gateway.outages)."""

    def __init__(self, cfg: GatewayConfig) -> None:
        setup_logging(cfg.log_level)
        self.cfg = cfg
        self.app = create_app(cfg)
        self.server = uvicorn.Server(_uvicorn_config(cfg, self.app))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self._run, name="epd-gateway", daemon=True)
        self._error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    @property
    def gateway(self):
        return self.app.state.gateway

    def _run(self) -> None:
        async def serve() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve()

        try:
            asyncio.run(serve())
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._error = exc

    def call_soon(self, fn, *args) -> None:
        """`fn(*args)` on the gateway's event loop (dropped once the gateway has stopped)."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(fn, *args)

    def start(self, timeout_s: float = 15.0) -> GatewayThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start on {self.url}: "
                                   f"{self._error or 'timeout (port in use?)'}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ScalingPort:
    """`epd up`'s scaler's calls on a gateway running in this process (`GatewayThread`).

    Its pools live on the gateway's event loop: every call runs there. `thread`: anything with
    the `GatewayThread` members `gateway`, `loop` and `call_soon`."""

    def __init__(self, thread: Any) -> None:
        self._thread = thread

    @property
    def metrics(self) -> Any:
        return self._thread.gateway.metrics

    def load(self) -> dict[str, float] | None:
        return self._on_loop(self._thread.gateway.fleet.load)

    def add(self, role: str, url: str) -> None:
        gw = self._thread.gateway
        if role == "encoder":
            self._thread.call_soon(lambda: gw.router.add(gw.encoder_client(url)))
        else:
            self._thread.call_soon(lambda: gw.decoders.add(url))

    def drain(self, role: str, url: str, timeout_s: float) -> tuple[int, Future[bool]]:
        gw = self._thread.gateway
        pool = gw.router if role == "encoder" else gw.decoders
        inflight = self._on_loop(lambda: pool.inflight.get(url, 0)) or 0
        return inflight, asyncio.run_coroutine_threadsafe(pool.drain(url, timeout_s),
                                                          self._thread.loop)

    def publish(self, view: Callable[[], dict[str, Any]]) -> None:
        self._thread.gateway.admin.show_scaling(view)

    def _on_loop(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the gateway's event loop; None if it is gone."""
        loop = self._thread.loop
        if loop is None or loop.is_closed():
            return None

        async def call() -> Any:
            return fn()

        try:
            return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=5)
        except (RuntimeError, TimeoutError, asyncio.TimeoutError):
            return None
