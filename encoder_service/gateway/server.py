"""Run the gateway, blocking or on a background thread.

Run the gateway: `serve` (blocking, for `epd gateway`), `GatewayThread` (in-process, for
`epd up`, tests and benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

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
