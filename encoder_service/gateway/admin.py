"""The gateway's control plane: health, instances, and joining or leaving.

The gateway's control plane: GET /health (is any prefill/decode instance up?), GET
/instances (each encoder, prefill and decode instance: state, load, what it was given, its
last probe; it names internal addresses, so with client API keys configured it answers a
client key or the admin token only) and POST /admin/instances (instances join and leave at
run time; the deployment's admin token, or loopback callers only when there is no secret).

POST /instances and DELETE /instances?url=URL take vLLM's own registration format, the one
of its EPD proxy example (`examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py`
in vLLM 0.32-0.34): {"role": "encode"|"prefill"|"decode"|"prefill_decode", "url": ...,
"ec_zmq_addrs": [...], "dp_size": N}, so vLLM's launch scripts register with this gateway
unchanged. Roles map onto the gateway's: encode -> encoder, prefill_decode -> decoder
(E+PD), prefill and decode -> the prefill and decode pools (E/P/D gateways only). Same
admin rule as POST /admin/instances; the token may also come as `X-API-Key` (what vLLM's
scripts send)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse

from ec_connectors.protocol.http_api import KeyCheck, error_type
from encoder_service.gateway.config import AdminChange, AdminSection, _check_base_url
from encoder_service.gateway.requests.admission import Admission
from encoder_service.gateway.upstreams.decoders import DecodePool
from encoder_service.gateway.upstreams.encoder_clients import EncoderClient, EncoderRouter
from encoder_service.gateway.upstreams.probes import Prober
from encoder_service.gateway.wire import GatewayError
from epd_common.net import is_loopback

logger = logging.getLogger("epd.gateway")
VLLM_ROLES = ("encode", "prefill", "decode", "prefill_decode")


class VllmRegistration(BaseModel):
    """vLLM's EPD proxy registration body (its `InstanceRegistration`, vLLM 0.32-0.34)."""

    model_config = ConfigDict(extra="forbid")
    role: str
    url: str
    ec_zmq_addrs: list[str] = Field(default_factory=list)  # Mooncake push: not used here
    dp_size: int = Field(1, ge=1)  # the instance balances its replicas behind one URL

    @model_validator(mode="after")
    def _check(self) -> VllmRegistration:
        if self.role not in VLLM_ROLES:
            raise ValueError(f"role must be one of {', '.join(VLLM_ROLES)}")
        self.url = _check_base_url(self.url.rstrip("/"))
        if self.ec_zmq_addrs and len(self.ec_zmq_addrs) != self.dp_size:
            raise ValueError("Provide one Mooncake control address per DP replica")
        if self.ec_zmq_addrs and self.role not in ("prefill", "prefill_decode"):
            raise ValueError("Only EC consumers accept Mooncake addresses")
        return self


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

    def _allowed(self, request: Request, api_key_header: bool = False) -> bool:
        if self.section.token is not None:
            if api_key_header and request.headers.get("x-api-key"):
                return self._is_admin(request.headers["x-api-key"])
            return self._is_admin(request.headers.get("authorization", ""))
        client = request.client
        return client is not None and is_loopback(client.host)

    def _refused(self, request: Request) -> JSONResponse | None:
        """POST/DELETE /instances: 404 with admin endpoints off, 403 without the admin rule."""
        if not self.section.routing.admin:
            return JSONResponse({"error": "admin endpoints are off (routing.admin)"}, 404)
        if not self._allowed(request, api_key_header=True):
            return JSONResponse({"error": "registration needs the deployment's admin token "
                                 "(`epd admin-token`) as a Bearer token or X-API-Key; without "
                                 "a secret, loopback callers only"}, 403)
        return None

    def _vllm_pool(self, role: str) -> tuple[str, DecodePool | None] | None:
        """(our role, its pool; None for encoders) of a vLLM role.

        None where this gateway's topology has no such role (E+PD has no split
        prefill/decode, E/P/D no prefill_decode)."""
        if role == "encode":
            return "encoder", None
        if self.prefills is None:
            return ("decoder", self.decoders) if role == "prefill_decode" else None
        return {"prefill": ("prefill", self.prefills),
                "decode": ("decoder", self.decoders)}.get(role)

    def _holder(self, url: str) -> str | None:
        if url in self.router.clients:
            return "encoder"
        if self.prefills is not None and url in self.prefills.urls:
            return "prefill"
        return "decoder" if url in self.decoders.urls else None

    async def vllm_register(self, request: Request) -> JSONResponse:
        """POST /instances (vLLM's format): {"registered": true} when it joined.

        False when it was there already; 409 for a role this gateway's topology lacks or a
        URL that holds another role, 400 for a malformed body."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        try:
            body = VllmRegistration.model_validate(await self.admission.read_json(request))
        except GatewayError as exc:
            return JSONResponse(exc.body(), exc.status)
        except (ValidationError, ValueError) as exc:
            return JSONResponse({"detail": f"bad registration: {exc}"}, 400)
        mapped = self._vllm_pool(body.role)
        if mapped is None:
            topology = "E/P/D (prefill, decode)" if self.prefills is not None else \
                "E+PD (prefill_decode)"
            return JSONResponse({"detail": f"this gateway runs {topology}: role "
                                 f"{body.role!r} cannot join it"}, 409)
        ours, pool = mapped
        holder = self._holder(body.url)
        if holder is not None and holder != ours:
            return JSONResponse({"detail": "Unregister the instance before changing its role"},
                                409)
        if holder == ours:
            return JSONResponse({"registered": False})
        if pool is None:
            self.router.add(self.encoder_client(body.url))
        else:
            pool.add(body.url)
        logger.info("instance joined role=%s url=%s (vLLM registration, role %s)", ours,
                    body.url, body.role)
        return JSONResponse({"registered": True})

    async def vllm_unregister(self, request: Request) -> JSONResponse:
        """DELETE /instances?url=URL (vLLM's format): {"removed": bool}, drained first."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        url = (request.query_params.get("url") or "").rstrip("/")
        holder = self._holder(url)
        if holder is None:
            return JSONResponse({"removed": False})
        if holder == "prefill":
            assert self.prefills is not None
            drained = await self.prefills.drain(url, 60.0)
            logger.info("instance left role=prefill url=%s drained=%s", url, drained)
            return JSONResponse({"removed": True})
        answer = await self._remove(AdminChange(role=holder, url=url, action="remove"))
        if answer.status_code != 200:
            return answer
        return JSONResponse({"removed": True})

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
