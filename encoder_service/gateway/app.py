"""The gateway's ASGI app: an OpenAI-compatible endpoint in front of EPD vLLM instances.

This file wires the parts together and owns their lifecycle and routes. Reading path:
POST /v1/chat/completions is the chat flow (chat.py: parsing.py validates and tags the
media, availability.py skips items already available, encoder_clients.py encodes the rest,
decoders.py opens the request with its ec_transfer_params on a prefill/decode instance;
E/P/D: kv_handoff.py prefills it first and hands the KV cache to a decode instance),
relayed to the client by relay.py (SSE chunks forwarded as they arrive; failover: resume.py
and failover.py). POST /v1/completions and GET /v1/models are passed through (here). GET
/health, GET /instances, POST /admin/instances: admin.py. GET /metrics. Admission (request
slots, bounded body reads): admission.py. A client disconnect cancels the upstream calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ec_connectors.protocol.http_api import require_key
from ec_connectors.protocol.secret import admin_token, read_secret
from encoder_service.gateway.admin import Admin
from encoder_service.gateway.admission import Admission, request_id
from encoder_service.gateway.auth import upstream_headers
from encoder_service.gateway.availability import make_availability
from encoder_service.gateway.chat import ChatFlow
from encoder_service.gateway.coalescing import CoalescingClient
from encoder_service.gateway.codec import json_encode
from encoder_service.gateway.config import GatewayConfig
from encoder_service.gateway.decoders import DecodePool
from encoder_service.gateway.encoder_clients import (
    EncoderClient,
    EncoderRouter,
    PoolEncoderClient,
    VllmEncoderClient,
)
from encoder_service.gateway.errors import GatewayError
from encoder_service.gateway.kv_handoff import KvHandoff
from encoder_service.gateway.metrics import GatewayMetrics
from encoder_service.gateway.outages import Outages
from encoder_service.gateway.probes import Prober
from encoder_service.gateway.relay import Exchange, Relay, Watch
from encoder_service.gateway.routing import Chooser
from encoder_service.gateway.tracing import Tracer, make_tracer

logger = logging.getLogger("epd.gateway")


class Gateway:
    """State shared by the handlers: config, upstream clients, metrics, and the handlers'
    owners (`flow`: the chat flow, `admin`: the control plane), made at start-up."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.metrics = GatewayMetrics()
        self.availability = make_availability(cfg)
        self.ids = cfg.ids  # signs the item ids it derives (with the deployment secret)
        secret = read_secret(cfg.secret_file)
        self._admin_token = None if secret is None else admin_token(secret)
        self.admission = Admission(cfg.limits)
        self.relay = Relay(self.metrics, cfg.timeouts.decode_s)
        self.client: httpx.AsyncClient | None = None
        self.fetch_client: httpx.AsyncClient | None = None
        self.router: EncoderRouter | None = None
        self.decoders: DecodePool | None = None
        self.kv: KvHandoff | None = None  # E/P/D: the prefill instances (cfg.prefills)
        self.prober: Prober | None = None  # None: no periodic probes
        self.outages: Outages | None = None  # instances a supervisor (epd up) reports down
        self.flow: ChatFlow | None = None
        self.admin: Admin | None = None
        self.tracer: Tracer | None = None  # traces (tracing.py): None when off

    # -- lifecycle -------------------------------------------------------------------------
    async def startup(self) -> None:
        t = self.cfg.timeouts
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(
            connect=t.connect_s, read=t.decode_s, write=t.decode_s, pool=t.connect_s),
            headers=upstream_headers(self.cfg.secret_file))  # the deployment's key (auth.py)
        self.fetch_client = httpx.AsyncClient(trust_env=False)
        r = self.cfg.routing
        self.router = EncoderRouter([self._encoder_client(u) for u in self.cfg.encoders],
                                    cooldown_s=self.cfg.cooldown_s,
                                    chooser=Chooser(r.encoders, r.load_factor),
                                    single_flight=r.single_flight)
        self.decoders = DecodePool(self.cfg, self.metrics)
        self.kv = KvHandoff(self.cfg, self.metrics) if self.cfg.prefills else None
        self.tracer = make_tracer(self.cfg.tracing, self.metrics)
        self.flow = ChatFlow(self.cfg, self.metrics, self.availability, self.ids, self.router,
                             self.decoders, self.fetch_client, self.admission, self.relay,
                             self.kv, self.tracer)
        await self.decoders.start()
        if self.kv is not None:
            await self.kv.start()
        prober = Prober(self.client, self.cfg.model, r.probe_interval_s, r.probe_timeout_s,
                        self._probe_targets, self._probed)
        self.outages = Outages(self._pools(), prober, self._probe_kind)
        if r.probe_interval_s > 0:
            self.prober = prober
            self.prober.start()
        self.admin = Admin(self.cfg, self.client, self.router, self.decoders, self.prober,
                           self.admission, self._admin_token, self._encoder_client,
                           prefills=self.kv.pool if self.kv is not None else None)
        logger.info("gateway ready model=%s encoders=%s (%s) decoders=%s prefills=%s "
                    "availability=%s", self.cfg.model, self.cfg.encoders,
                    self.cfg.encoder_backend, self.cfg.decoders, self.cfg.prefills,
                    self.availability.name)
        if self.tracer is not None:
            logger.info("tracing on: spans to %s (sample_ratio %s), traceparent to every "
                        "upstream", self.cfg.tracing.otlp_traces_endpoint,
                        self.cfg.tracing.sample_ratio)

    def _pools(self) -> list:
        """Every upstream pool: decode instances, encoders, prefill instances (E/P/D)."""
        assert self.decoders is not None and self.router is not None
        return [self.decoders, self.router, *([self.kv.pool] if self.kv is not None else [])]

    def _probe_targets(self) -> list[tuple[str, str]]:
        """Every instance but those down (a supervisor probes them back: outages.py)."""
        return [(u, self._probe_kind(u)) for pool in self._pools() for u in pool.names()
                if u not in pool.down]

    def _probe_kind(self, url: str) -> str:
        assert self.decoders is not None
        pool = (self.cfg.encoder_backend == "pool" and url not in self.decoders.urls
                and url not in self.cfg.prefills)
        return "pool" if pool else "vllm"

    def _probed(self, url: str, ok: bool) -> None:
        """A failed probe: tried last until the next probe passes; a passed one clears it."""
        assert self.decoders is not None and self.router is not None
        r = self.cfg.routing
        hold = 0.0 if ok else max(self.cfg.cooldown_s, r.probe_interval_s + r.probe_timeout_s)
        for pool in self._pools():
            if url in pool.down_until:
                pool.cool_down(url, hold)
        if not ok:
            result = self.outages.prober.results.get(url) if self.outages else None
            logger.warning("probe failed url=%s error=%s action=tried last until a probe "
                           "passes", url, result.error if result else "")

    def _encoder_client(self, url: str) -> EncoderClient:
        assert self.client is not None
        t = self.cfg.timeouts.encoder_s
        if self.cfg.encoder_backend == "pool":  # the pool batches across calls itself
            return PoolEncoderClient(url, self.client, t)
        r = self.cfg.routing  # coalesce_items 1: every request alone, still counted
        return CoalescingClient(VllmEncoderClient(url, self.cfg.model, self.client, t),
                                r.coalesce_items, r.encoder_calls, t,
                                self.metrics.encoder_call_items.observe)

    async def shutdown(self) -> None:
        if self.prober is not None:
            await self.prober.stop()
        if self.outages is not None:
            await self.outages.close()
        if self.flow is not None:
            await self.flow.drain(self.cfg.timeouts.connect_s)
        if self.decoders is not None:
            await self.decoders.close()
        if self.kv is not None:
            await self.kv.close()
        for c in (self.client, self.fetch_client):
            if c is not None:
                await c.aclose()
        self.availability.close()
        if self.tracer is not None:  # what is queued goes out first (bounded)
            await asyncio.to_thread(self.tracer.close, self.cfg.timeouts.connect_s)

    # -- endpoints -------------------------------------------------------------------------
    async def chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.flow is not None
        await self.flow.chat(scope, receive, send)

    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        rid = request_id(request)
        t0 = time.perf_counter()
        refused = self.admission.admit()
        if refused is not None:
            await self.relay.error(refused, "completions", rid)(scope, receive, send)
            return
        try:
            await self._completions(request, rid, t0, scope, receive, send)
        finally:
            self.admission.leave()

    async def _completions(self, request: Request, rid: str, t0: float, scope: Scope,
                           receive: Receive, send: Send) -> None:
        assert self.decoders is not None
        decoders = self.decoders
        try:
            body = await self.admission.read_json(request)
            if not isinstance(body, dict):
                raise GatewayError(400, "request body must be a JSON object")
            model = body.setdefault("model", self.cfg.model)
            if model != self.cfg.model:
                raise GatewayError(404, f"model {model!r} is not served here; this gateway "
                                   f"serves {self.cfg.model!r}", "unknown_model")
            body.pop("ec_transfer_params", None)  # the gateway's to give, never a client's
            body.pop("kv_transfer_params", None)
            payload = json_encode(body)
        except GatewayError as exc:
            await self.relay.error(exc, "completions", rid)(scope, receive, send)
            return
        except ClientDisconnect:
            self.relay.client_gone(rid)
            return
        ex = Exchange(scope, receive, send, rid, t0, "completions", Watch(receive))

        async def answer() -> None:
            up = await decoders.request("POST", "/v1/completions", payload, rid)
            await self.relay.relay(up, ex, body.get("stream") is True, {})

        await self.relay.guarded(answer, ex)

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.decoders is not None
        rid = request_id(Request(scope, receive))
        try:
            up = await self.decoders.request("GET", "/v1/models", None, rid)
        except GatewayError as exc:
            await self.relay.error(exc, "models", rid)(scope, receive, send)
            return
        ex = Exchange(scope, receive, send, rid, time.perf_counter(), "models", Watch(receive))
        try:
            await self.relay.relay(up, ex, False, {})
        finally:
            ex.watch.finish()

    async def health(self, request: Request) -> JSONResponse:
        assert self.admin is not None
        return await self.admin.health(request)

    async def instances(self, request: Request) -> JSONResponse:
        assert self.admin is not None
        return await self.admin.instances(request)

    async def admin_instances(self, request: Request) -> JSONResponse:
        assert self.admin is not None
        return await self.admin.admin_instances(request)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)


class _Endpoint:
    """A raw ASGI endpoint (Starlette calls it with scope/receive/send)."""

    def __init__(self, fn: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.fn = fn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.fn(scope, receive, send)


class GatewayApp:
    """The ASGI app: the chat endpoint is dispatched straight to the handler (it sits on every
    request's path); everything else, lifespan included, goes through Starlette."""

    def __init__(self, gw: Gateway, app: Starlette) -> None:
        self.gateway = gw
        self.app = app
        self.state = app.state
        # client API keys on /v1 (auth.py); none configured: open, as before
        self.entry = require_key(self._dispatch, gw.cfg.client_api_keys,
                                 on_refused=gw.metrics.rejected.labels("invalid_api_key").inc)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.entry(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"] == "/v1/chat/completions"
                and scope["method"] == "POST"):
            await self.gateway.chat(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def create_app(cfg: GatewayConfig) -> GatewayApp:
    """The gateway app; `app.gateway` is the Gateway (metrics, router, pools)."""
    gw = Gateway(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await gw.startup()
        try:
            yield
        finally:
            await gw.shutdown()

    routes = [
        Route("/v1/chat/completions", _Endpoint(gw.chat), methods=["POST"]),
        Route("/v1/completions", _Endpoint(gw.completions), methods=["POST"]),
        Route("/v1/models", _Endpoint(gw.models), methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/instances", gw.instances, methods=["GET"]),
        Route("/admin/instances", gw.admin_instances, methods=["POST"]),
        Route("/metrics", gw.metrics_endpoint, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gw
    return GatewayApp(gw, app)
