"""The gateway's control plane: health, instances, and joining or leaving.

The gateway's control plane: GET /health (is any prefill/decode instance up?), GET
/instances (each encoder, prefill and decode instance: state, load, what it was given, its
last probe; it names internal addresses, so with client API keys configured it answers a
client key or the admin token only) and POST /admin/instances (instances join and leave at
run time; the deployment's admin token, or loopback callers only when there is no secret)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse

from ec_connectors.protocol.http_api import KeyCheck, error_type
from encoder_service.gateway.config import AdminChange, AdminSection
from encoder_service.gateway.requests.admission import Admission
from encoder_service.gateway.upstreams.decoders import DecodePool
from encoder_service.gateway.upstreams.encoder_clients import EncoderClient, EncoderRouter
from encoder_service.gateway.upstreams.probes import Prober
from encoder_service.gateway.wire import GatewayError
from epd_common.net import is_loopback

logger = logging.getLogger("epd.gateway")


class Admin:
    """The control-plane handlers over the gateway's pools (made at start-up).

    `encoder_client(url)` makes the client of an encoder that joins."""

    def __init__(self, section: AdminSection, client: httpx.AsyncClient, router: EncoderRouter,
                 decoders: DecodePool, prober: Prober | None, admission: Admission,
                 encoder_client: Callable[[str], EncoderClient],
                 prefills: DecodePool | None = None) -> None:
        self.section = section
        self.client = client
        self.router = router
        self.decoders = decoders
        self.prober = prober
        self.admission = admission
        self.encoder_client = encoder_client
        self.prefills = prefills  # E/P/D: the prefill instances (kv_handoff.py)
        self._scaling: Callable[[], dict] | None = None  # show_scaling
        keys = list(section.client_keys)
        self.readers = KeyCheck(keys) if keys else None  # who may GET /instances

    def show_scaling(self, view: Callable[[], dict]) -> None:
        """Show `view()` under "scaling" in GET /instances (`epd top` prints it).

        `epd up`'s scaler (local/scaler.py) publishes its roles and recent decisions."""
        self._scaling = view

    async def health(self, request: Request) -> JSONResponse:
        """GET /health: whether any prefill/decode instance is up.

        200 when at least one prefill/decode instance is healthy (encoders are optional:
        without them requests still succeed, encoded locally)."""
        timeout = self.section.health_s

        async def probe(url: str) -> bool:
            try:
                r = await self.client.get(url + "/health", timeout=timeout)
                return r.status_code == 200
            except httpx.HTTPError:
                return False

        decoders, encoders = list(self.decoders.urls), list(self.router.clients)
        urls = [*decoders, *encoders]
        oks = await asyncio.gather(*(probe(u) for u in urls))
        state = dict(zip(urls, oks, strict=True))
        dec = {u: state[u] for u in decoders}
        enc = {u: state[u] for u in encoders}
        ok = any(dec.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "decoders": dec,
                             "encoders": enc}, status_code=200 if ok else 503)

    async def instances(self, request: Request) -> JSONResponse:
        """GET /instances: the state and load of every instance.

        Each encoder, prefill (E/P/D only) and decode instance: state (up, cooling_down,
        draining, down), in flight, and what it was given (decoders: `affinity` = requests
        that went to their first item's own instance). With client API keys configured, a
        caller presenting neither one of them nor the admin token gets a 401."""
        if not self._may_list(request):
            return JSONResponse({"error": {
                "message": "GET /instances names internal addresses: send a client API key "
                "or the admin token (`epd admin-token`) as `Authorization: Bearer <key>`",
                "type": error_type(401), "code": "invalid_api_key"}}, 401,
                headers={"www-authenticate": "Bearer"})
        probes = self.prober.results if self.prober is not None else {}
        out = {"encoders": self.router.describe(), "decoders": self.decoders.describe(),
               "routing": self.section.routing.model_dump()}
        if self.prefills is not None:
            out["prefills"] = self.prefills.describe()
        if self._scaling is not None:
            out["scaling"] = self._scaling()
        for entry in (*out["encoders"], *out.get("prefills", ()), *out["decoders"]):
            if entry["url"] in probes:
                entry["probe"] = probes[entry["url"]].describe()
        return JSONResponse(out)

    def _may_list(self, request: Request) -> bool:
        """GET /instances: open without client keys, else a client key or the admin token."""
        if self.readers is None:
            return True
        authorization = request.headers.get("authorization")
        return self.readers.admits(authorization) or (
            self.section.token is not None and self._is_admin(authorization or ""))

    def _is_admin(self, authorization: str) -> bool:
        given = authorization.removeprefix("Bearer ").strip()
        assert self.section.token is not None
        return hmac.compare_digest(given.encode(), self.section.token.encode())

    def _allowed(self, request: Request) -> bool:
        if self.section.token is not None:
            return self._is_admin(request.headers.get("authorization", ""))
        client = request.client
        return client is not None and is_loopback(client.host)

    async def admin_instances(self, request: Request) -> JSONResponse:
        """POST /admin/instances: add or remove an instance at run time.

        POST {"role": "encoder"|"decoder", "url": BASE_URL, "action": "add"|"remove",
        "drain_timeout_s": 60}: join or leave at run time. A removed instance gets nothing new
        and is forgotten once its requests in flight are done (or the timeout passed)."""
        if not self.section.routing.admin:
            return JSONResponse({"error": "admin endpoints are off (routing.admin)"}, 404)
        if not self._allowed(request):
            return JSONResponse({"error": "admin endpoints need the deployment's admin token "
                                 "(`epd admin-token`) as a Bearer token; without a secret, "
                                 "loopback callers only"}, 403)
        try:
            change = AdminChange.model_validate(await self.admission.read_json(request))
        except GatewayError as exc:
            return JSONResponse(exc.body(), exc.status)
        except ValueError as exc:
            return JSONResponse({"error": f"bad admin request: {exc}"}, 400)
        if change.action == "add":
            if change.role == "encoder":
                self.router.add(self.encoder_client(change.url))
            else:
                self.decoders.add(change.url)
            logger.info("instance joined role=%s url=%s", change.role, change.url)
            return JSONResponse({"url": change.url, "role": change.role, "state": "up"})
        return await self._remove(change)

    async def _remove(self, change: AdminChange) -> JSONResponse:
        url = change.url
        known = self.router.clients if change.role == "encoder" else self.decoders.urls
        if url not in known:
            return JSONResponse({"error": f"no {change.role} {url}"}, 404)
        if change.role == "decoder" and len(self.decoders.urls) - len(
                self.decoders.draining) <= 1 and url not in self.decoders.draining:
            return JSONResponse({"error": "the last prefill/decode instance cannot leave"},
                                409)
        pool = self.router if change.role == "encoder" else self.decoders
        logger.info("instance leaving role=%s url=%s action=draining", change.role, url)
        drained = await pool.drain(url, change.drain_timeout_s)
        logger.info("instance left role=%s url=%s drained=%s", change.role, url, drained)
        return JSONResponse({"url": url, "role": change.role, "state": "removed",
                             "drained": drained})
