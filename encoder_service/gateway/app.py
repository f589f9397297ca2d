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
from encoder_service.gateway.admin import Admin
from encoder_service.gateway.config import GatewayConfig
from encoder_service.gateway.requests.admission import Admission, request_id
from encoder_service.gateway.requests.chat import ChatFlow
from encoder_service.gateway.requests.relay import Exchange, Relay, Watch
from encoder_service.gateway.telemetry.metrics import GatewayMetrics
from encoder_service.gateway.telemetry.tracing import make_tracer
from encoder_service.gateway.upstreams.availability import make_availability
from encoder_service.gateway.upstreams.coalescing import EncoderClientMaker
from encoder_service.gateway.upstreams.decoders import DecodePool
from encoder_service.gateway.upstreams.encoder_clients import (
    EncoderRouter,
)
from encoder_service.gateway.upstreams.fleet import Fleet
from encoder_service.gateway.upstreams.kv_handoff import KvHandoff
from encoder_service.gateway.upstreams.outages import Outages
from encoder_service.gateway.upstreams.probes import Prober
from encoder_service.gateway.upstreams.routing import Chooser
from encoder_service.gateway.wire import GatewayError, json_encode, served_body

logger = logging.getLogger("epd.gateway")


class Gateway:
    """The gateway's shared state: upstream clients, pools, metrics and handlers.

    State shared by the handlers: the upstream clients and pools, metrics, and the
    handlers' owners (`flow`: the chat flow, `admin`: the control plane). Everything is made
    here, from the config's sections; `startup()` only starts what needs the event loop."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.model = cfg.model
        self.metrics = GatewayMetrics()
        self.grace_s = cfg.timeouts.connect_s  # for what is in flight at shutdown
        t, r = cfg.timeouts, cfg.routing
        pool_encoders = cfg.encoder_backend == "pool"
        decode, prefill = cfg.pool("decode"), cfg.pool("prefill") if cfg.prefills else None
        self.admission = Admission(cfg.limits)
        self.relay = Relay(self.metrics, t.decode_s)
        self.tracer = make_tracer(cfg.tracing, self.metrics)  # None when tracing is off
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
            timeout=httpx.Timeout(connect=t.connect_s, read=t.decode_s, write=t.decode_s,
                                  pool=t.connect_s),
            headers=decode.headers)  # the deployment's key (auth.py)
        self.fetch_client = httpx.AsyncClient(trust_env=False)
        self.encoder_client = EncoderClientMaker(
            pool_encoders, cfg.model, self.client, t.encoder_s, r.coalesce_items,
            r.encoder_calls, self.metrics.encoder_call_items.observe)
        clients = [self.encoder_client(u) for u in cfg.encoders]
        self.router = EncoderRouter(clients, cfg.cooldown_s, Chooser(r.encoders, r.load_factor),
                                    r.single_flight)
        self.decoders = DecodePool(decode, self.metrics)
        prefills = DecodePool(prefill) if prefill is not None else None
        # E/P/D: the prefill hop before each decode request
        self.kv = KvHandoff(prefills, self.metrics) if prefills is not None else None
        self.fleet = Fleet(self.decoders, self.router, prefills, pool_encoders,
                           max(cfg.cooldown_s, r.probe_interval_s + r.probe_timeout_s))
        prober = Prober(self.client, cfg.model, r.probe_interval_s, r.probe_timeout_s,
                        self.fleet.probe_targets, self.fleet.probed)
        self.fleet.prober = prober
        self.metrics.watch_load(self.fleet.load)
        self.prober = prober if r.probe_interval_s > 0 else None  # None: no periodic probes
        self.outages = Outages(self.fleet.pools(), prober, self.fleet.probe_kind)
        self.flow = ChatFlow(cfg.chat, self.metrics, None, cfg.ids, self.router,
                             self.decoders, self.fetch_client, self.admission, self.relay,
                             self.kv, self.tracer)
        self.admin = Admin(cfg.admin, self.client, self.router, self.decoders, self.prober,
                           self.admission, self.encoder_client, prefills=prefills)
        # last: the availability view runs a catalog thread for the Mooncake TE
        self.availability = make_availability(cfg.availability, cfg.namespace, cfg.secret_file)
        self.flow.availability = self.availability
        self.client_keys = cfg.client_api_keys  # on /v1 (auth.py); none: open
        self.ready_line = (
            f"gateway ready model={cfg.model} encoders={cfg.encoders} "
            f"({cfg.encoder_backend}) decoders={cfg.decoders} prefills={cfg.prefills} "
            f"availability={self.availability.name}")
        if self.tracer is not None:
            self.ready_line += (f"; tracing on: spans to {cfg.tracing.otlp_traces_endpoint} "
                                f"(sample_ratio {cfg.tracing.sample_ratio}), traceparent to "
                                "every upstream")

    # -- lifecycle -------------------------------------------------------------------------
    async def startup(self) -> None:
        await self.decoders.start()
        if self.kv is not None:
            await self.kv.start()
        if self.prober is not None:
            self.prober.start()
        logger.info(self.ready_line)

    async def shutdown(self) -> None:
        if self.prober is not None:
            await self.prober.stop()
        await self.outages.close()
        await self.flow.drain(self.grace_s)
        await self.decoders.close()
        if self.kv is not None:
            await self.kv.close()
        for c in (self.client, self.fetch_client):
            await c.aclose()
        self.availability.close()
        if self.tracer is not None:  # what is queued goes out first (bounded)
            await asyncio.to_thread(self.tracer.close, self.grace_s)

    # -- endpoints -------------------------------------------------------------------------
    async def chat(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        decoders = self.decoders
        try:
            body = served_body(await self.admission.read_json(request), self.model)
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
        return await self.admin.health(request)

    async def instances(self, request: Request) -> JSONResponse:
        return await self.admin.instances(request)

    async def admin_instances(self, request: Request) -> JSONResponse:
        return await self.admin.admin_instances(request)

    async def vllm_register(self, request: Request) -> JSONResponse:
        return await self.admin.vllm_register(request)

    async def vllm_unregister(self, request: Request) -> JSONResponse:
        return await self.admin.vllm_unregister(request)

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
    """The gateway's ASGI app, with a fast path for the chat endpoint.

    The ASGI app: the chat endpoint is dispatched straight to the handler (it sits on every
    request's path); everything else, lifespan included, goes through Starlette."""

    def __init__(self, gw: Gateway, app: Starlette) -> None:
        self.gateway = gw
        self.app = app
        self.state = app.state
        # client API keys on /v1 (auth.py); none configured: open, as before
        self.entry = require_key(self._dispatch, gw.client_keys,
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
        Route("/instances", gw.vllm_register, methods=["POST"]),  # vLLM's registration
        Route("/instances", gw.vllm_unregister, methods=["DELETE"]),
        Route("/admin/instances", gw.admin_instances, methods=["POST"]),
        Route("/metrics", gw.metrics_endpoint, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.gateway = gw
    return GatewayApp(gw, app)
