"""The gateway's ASGI app: an OpenAI-compatible endpoint in front of EPD vLLM instances.

POST /v1/chat/completions: validate + tag media (parsing.py), skip items already available
(availability.py), encode the rest (encoder_clients.py), send the request with its
ec_transfer_params to a prefill/decode instance (decoders.py) and pass the answer through
(SSE chunks are forwarded as they arrive). POST /v1/completions and GET /v1/models are passed
through. GET /health, GET /metrics. A client disconnect cancels the upstream calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ec_connectors.protocol.params import PARAMS_KEY
from ec_connectors.protocol.secret import admin_token, is_loopback, read_secret
from encoder_service.gateway.auth import require_key, upstream_headers
from encoder_service.gateway.availability import make_availability
from encoder_service.gateway.config import AdminChange, GatewayConfig
from encoder_service.gateway.decoders import DecodePool, Upstream, UpstreamError
from encoder_service.gateway.encoder_clients import (
    CoalescingClient,
    EncodeOutcome,
    EncoderClient,
    EncoderRouter,
    PoolEncoderClient,
    VllmEncoderClient,
)
from encoder_service.gateway.errors import GatewayError
from encoder_service.gateway.failover import (
    ResumeMismatch,
    StreamTracker,
    upstream_body,
)
from encoder_service.gateway.metrics import GatewayMetrics
from encoder_service.gateway.parsing import (
    metadata_only_body,
    placeholder_metadata,
    prepare_chat,
)
from encoder_service.gateway.probes import Prober
from encoder_service.gateway.resume import Resumer
from encoder_service.gateway.routing import Chooser
from encoder_service.gateway.urls import fetch_media

logger = logging.getLogger("epd.gateway")
_RID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _request_id(request: Request) -> str:
    """The client's x-request-id when it is short and safe, else a fresh one."""
    rid = request.headers.get("x-request-id", "")
    return rid if _RID.fullmatch(rid) else uuid.uuid4().hex


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


async def _discard(task: asyncio.Task) -> None:
    """Cancel a decode request opened early; one that opened already is released (closing
    its connection aborts the request in vLLM)."""
    task.cancel()
    await asyncio.wait([task])  # never raises the task's error; our own cancellation does
    if not task.cancelled() and task.exception() is None:
        await task.result()[0].release()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# msgspec's JSON codec: a 50 KB chat body (a base64 image) encodes in ~30 us, json.dumps
# takes ~300 us (measured here); decode errors are ValueErrors like json's.
_json_decode = msgspec.json.decode
_json_encode = msgspec.json.encode
_MAX_REMEMBERED = 65536  # placeholder metadata of this many items (about 150 B each)

class _Watch:
    """Cancels the handler's task when the client disconnects, until `finish()`.

    One watcher task per request (started after the body was read) covers every await:
    encoding, waiting for the decode instance, relaying. Cancelling the handler closes the
    upstream connections on the way out, which aborts the requests there."""

    def __init__(self, receive: Receive) -> None:
        self.task = asyncio.current_task()
        self.gone = False
        self.active = True
        self.watcher = asyncio.ensure_future(_wait_disconnect(receive))
        self.watcher.add_done_callback(self._fired)

    def _fired(self, fut: asyncio.Future) -> None:
        if not self.active or fut.cancelled() or fut.exception() is not None:
            return
        self.gone = True
        if self.task is not None:
            self.task.cancel()

    def finish(self) -> None:
        """Call right before the last send: a disconnect after it is a normal close."""
        self.active = False
        self.watcher.cancel()


class Gateway:
    """State shared by the handlers: config, upstream clients, metrics."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.metrics = GatewayMetrics()
        self.availability = make_availability(cfg)
        self.ids = cfg.ids  # signs the item ids it derives (with the deployment secret)
        secret = read_secret(cfg.secret_file)
        self._admin_token = None if secret is None else admin_token(secret)
        self.client: httpx.AsyncClient | None = None
        self.fetch_client: httpx.AsyncClient | None = None
        self.router: EncoderRouter | None = None
        self.decoders: DecodePool | None = None
        self._background: set[asyncio.Task] = set()  # releases in flight (strong refs)
        self.prober: Prober | None = None
        self._active = 0  # chat/completions requests admitted and not finished
        # item id -> placeholder metadata its encoder published: a later request for an
        # item that is already available goes metadata-only too
        self._metadata: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # modality -> whether its encoders' last answer carried placeholder metadata
        self._publishes_metadata: dict[str, bool] = {}

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
        self.decoders = DecodePool(self.cfg)
        self.resumer = Resumer(self.decoders, self.cfg.model, self.cfg.timeouts.decode_s)
        await self.decoders.start()
        if r.probe_interval_s > 0:
            self.prober = Prober(self.client, self.cfg.model, r.probe_interval_s,
                                 r.probe_timeout_s, self._probe_targets, self._probed)
            self.prober.start()
        logger.info("gateway ready model=%s encoders=%s (%s) decoders=%s availability=%s",
                    self.cfg.model, self.cfg.encoders, self.cfg.encoder_backend,
                    self.cfg.decoders, self.availability.name)

    def _probe_targets(self) -> list[tuple[str, str]]:
        assert self.decoders is not None and self.router is not None
        kind = "pool" if self.cfg.encoder_backend == "pool" else "vllm"
        return [*((u, "vllm") for u in self.decoders.urls),
                *((u, kind) for u in self.router.clients)]

    def _probed(self, url: str, ok: bool) -> None:
        """A failed probe: tried last until the next probe passes; a passed one clears it."""
        assert self.decoders is not None and self.router is not None
        r = self.cfg.routing
        hold = 0.0 if ok else max(self.cfg.cooldown_s, r.probe_interval_s + r.probe_timeout_s)
        for pool in (self.decoders, self.router):
            if url in pool.down_until:
                pool.cool_down(url, hold)
        if not ok:
            logger.warning("probe failed url=%s error=%s action=tried last until a probe "
                           "passes", url, self.prober.results[url].error if self.prober
                           else "")

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
        if self._background:
            await asyncio.wait(list(self._background), timeout=self.cfg.timeouts.connect_s)
        if self.decoders is not None:
            await self.decoders.close()
        for c in (self.client, self.fetch_client):
            if c is not None:
                await c.aclose()
        self.availability.close()

    def _release(self, outcome: EncodeOutcome | None) -> None:
        """Tell the encoders holding `outcome`'s items that the decode side is done with
        them (in the background; once per outcome)."""
        if outcome is not None and outcome.holders:
            task = asyncio.ensure_future(outcome.release())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    # -- helpers ---------------------------------------------------------------------------
    def _error(self, exc: GatewayError, endpoint: str, rid: str) -> JSONResponse:
        self.metrics.requests.labels(endpoint, str(exc.status)).inc()
        if exc.status < 500:
            self.metrics.rejected.labels(exc.reason).inc()
        logger.warning("request rejected rid=%s endpoint=%s status=%d reason=%s message=%r",
                       rid, endpoint, exc.status, exc.reason, exc.message)
        headers = {"x-request-id": rid}
        if exc.retry_after_s is not None:
            headers["retry-after"] = str(max(1, round(exc.retry_after_s)))
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def _admit(self) -> GatewayError | None:
        """A slot for one more chat/completions request, or the 429 to answer."""
        limit = self.cfg.limits.max_concurrent_requests
        if self._active >= limit:
            return GatewayError(429, f"the gateway has {limit} requests in flight "
                                "(limits.max_concurrent_requests); retry later",
                                "overloaded", retry_after_s=1.0)
        self._active += 1
        return None

    async def _read_json(self, request: Request) -> Any:
        limit = self.cfg.limits.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise GatewayError(413, f"request body is larger than {limit} bytes",
                               "request_too_large")
        chunks: list[bytes] = []

        async def read() -> None:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise GatewayError(413, f"request body is larger than {limit} bytes",
                                       "request_too_large")
                chunks.append(chunk)

        timeout = self.cfg.limits.body_read_timeout_s
        try:
            await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            raise GatewayError(408, f"the request body did not arrive within {timeout:g} s",
                               "body_timeout") from None
        try:
            return _json_decode(b"".join(chunks))
        except ValueError as exc:
            raise GatewayError(400, f"request body is not valid JSON: {exc}",
                               "bad_json") from None

    async def _fetch(self, url: str) -> tuple[bytes, str | None]:
        assert self.fetch_client is not None
        return await fetch_media(self.fetch_client, url, self.cfg.media, self.cfg.limits)

    # -- endpoints -------------------------------------------------------------------------
    async def chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        rid = _request_id(request)
        t0 = time.perf_counter()
        m = self.metrics
        refused = self._admit()
        if refused is not None:
            await self._error(refused, "chat", rid)(scope, receive, send)
            return
        m.inflight.inc()
        try:
            try:
                body = await self._read_json(request)
                prepared = await prepare_chat(body, self.cfg, self._fetch, self.ids)
            except GatewayError as exc:
                await self._error(exc, "chat", rid)(scope, receive, send)
                return
            except ClientDisconnect:  # gone while uploading: nothing was sent upstream
                self._client_gone(rid)
                return
            t_parse = time.perf_counter() - t0
            m.stage_parse.observe(t_parse)
            watch = _Watch(receive)
            held: list[EncodeOutcome] = []  # encoded items to release after the first token

            def release() -> None:
                self._release(held[0] if held else None)  # once: no-op when released

            wants_ids = prepared.body.get("return_token_ids") is True  # before routing adds it

            async def answer() -> None:
                up, info, sent = await self._route(prepared, rid, held)
                info["parse_ms"] = _ms(t_parse)
                resume = None
                if self.cfg.routing.failover:
                    def resume(tracker, failed_url):  # noqa: E306 - the answer's own
                        return self.resumer.resume(sent, tracker, failed_url, rid)
                await self._relay(up, scope, receive, send, rid, t0, "chat", prepared.stream,
                                  info, watch, on_first=release, resume=resume,
                                  wants_ids=wants_ids)

            try:
                await self._guarded(answer, watch, "chat", rid, scope, receive, send)
            finally:
                release()
        finally:
            m.inflight.dec()
            self._active -= 1

    async def _guarded(self, answer: Callable[[], Awaitable[None]], watch: _Watch,
                       endpoint: str, rid: str, scope: Scope, receive: Receive,
                       send: Send) -> None:
        """Run an upstream answer: a GatewayError becomes its HTTP error, a client that went
        away is counted (the upstream call was cancelled with it), the watch always ends."""
        try:
            await answer()
        except GatewayError as exc:
            watch.finish()
            await self._error(exc, endpoint, rid)(scope, receive, send)
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            self._client_gone(rid)
        finally:
            watch.finish()

    def _client_gone(self, rid: str) -> None:
        self.metrics.disconnects.inc()
        logger.info("client disconnected rid=%s; upstream requests cancelled", rid)

    async def _route(self, prepared: Any, rid: str, held: list[EncodeOutcome]
                     ) -> tuple[Upstream, dict[str, Any], dict[str, Any]]:
        """Encode what is missing (the outcome is appended to `held`) and open the decode
        request, after the encode or beside it (`_overlaps`); returns the decode request, the
        log fields and the body it was sent."""
        assert self.router is not None and self.decoders is not None
        ids = [it.item_id for it in prepared.items]
        hits = self.availability.available(ids) if ids else set()
        todo = [it for it in prepared.items if it.item_id not in hits]
        hints: dict[str, Any] = {i: self.availability.hint(i) for i in hits}
        info: dict[str, Any] = {"items": len(ids), "hits": len(hits), "encoded": 0,
                                "fallback": 0, "enc_retries": 0, "overlap": 0}
        key = ids[0] if ids else None  # its decode instance: where its first item went before
        if hits:
            self.metrics.items_hit.inc(len(hits))
        if not todo:
            return await self._open_decode(prepared, hints, rid, key, info)
        t = time.perf_counter()
        early: asyncio.Task | None = None
        if self._overlaps(todo):
            # The decode instance gets the request now, its new items marked pending: it
            # renders and preprocesses while they are encoded, then waits for them to land.
            pending = {**hints, **{it.item_id: {"pending": True} for it in todo}}
            early = asyncio.ensure_future(self._open_decode(prepared, pending, rid, key, info))
        try:
            outcome, errors = await self.router.encode(todo, rid)
        except BaseException:
            if early is not None:
                await _discard(early)
            raise
        held.append(outcome)
        self._count_encode(outcome, errors, rid, info, time.perf_counter() - t)
        for it in todo:  # what the encoders publish, learned from each answer (failed: none)
            hint = outcome.hints.get(it.item_id)
            if hint is not None:
                self._publishes_metadata[it.modality] = placeholder_metadata(hint) is not None
        hints.update(outcome.hints)
        if early is not None:
            if not outcome.failed:
                info["overlap"] = len(todo)
                self.metrics.items_overlapped.inc(len(todo))
                return await early
            # An item that will not land: ask again without its promise (it goes raw and
            # the decode instance encodes it) instead of letting the instance wait for it.
            await _discard(early)
        return await self._open_decode(prepared, hints, rid, key, info)

    def _overlaps(self, todo: list[Any]) -> bool:
        """Whether these new items go to the decode instance before they are encoded."""
        mode = self.cfg.routing.overlap
        if mode != "auto":
            return mode == "on"
        if self.availability.name == "none":
            return False
        if self.cfg.encoder_backend == "pool" and not all(map(PoolEncoderClient.takes, todo)):
            return False  # the pool sends it back: the early request would be thrown away
        # Only modalities whose encoders were seen to publish no placeholder metadata (the
        # decode instance needs their media anyway, e.g. LLaVA). The others wait for it and
        # go metadata-only: no media for the decode instance to decode and preprocess.
        return not self.cfg.media.metadata_only or all(
            self._publishes_metadata.get(it.modality) is False for it in todo)

    def _count_encode(self, outcome: EncodeOutcome, errors: list[str], rid: str,
                      info: dict[str, Any], seconds: float) -> None:
        m = self.metrics
        m.stage_encode.observe(seconds)
        info["encode_ms"] = _ms(seconds)
        info.update(encoded=len(outcome.hints) - outcome.shared, shared=outcome.shared,
                    fallback=len(outcome.failed), enc_retries=outcome.retries)
        m.items_encoded.inc(len(outcome.hints) - outcome.shared)
        if outcome.shared:
            m.items_shared.inc(outcome.shared)
        if outcome.retries:
            m.retries.labels("encoder").inc(outcome.retries)
        if errors:
            m.upstream_errors.labels("encoder").inc(len(errors))
        if outcome.failed:
            m.items.labels("fallback").inc(len(outcome.failed))
            m.fallbacks.inc()
            logger.warning("encoder failure rid=%s items=%d errors=%s action=sending raw "
                           "media (decode instance encodes locally)", rid,
                           len(outcome.failed), errors)
        elif errors:
            logger.warning("encoder retry rid=%s errors=%s action=retried on another "
                           "encoder, succeeded", rid, errors)

    async def _open_decode(self, prepared: Any, hints: dict[str, Any], rid: str,
                           key: str | None, info: dict[str, Any]
                           ) -> tuple[Upstream, dict[str, Any], dict[str, Any]]:
        """Open the decode request: `prepared.body` with `hints` as its ec_transfer_params,
        metadata-only parts where the items' metadata is known (once again with the raw media
        if that fails before the answer). `prepared.body` itself is left as it is."""
        m = self.metrics
        raw = dict(prepared.body)
        raw.pop("ec_transfer_params", None)
        metadata = self._placeholders(hints)
        if hints:
            raw["ec_transfer_params"] = {PARAMS_KEY: {"items": hints}}
        body, n_meta = (metadata_only_body(raw, metadata)
                        if metadata and self.cfg.media.metadata_only else (raw, 0))
        info["metadata_only"] = n_meta
        if prepared.stream and self.cfg.routing.failover:  # token ids: a break can resume
            body, raw = upstream_body(body), upstream_body(raw)
        up = await self._open("/v1/chat/completions", _json_encode(body), rid, key=key)
        if n_meta and await up.failed_before_answer(prepared.stream):
            # e.g. an embedding evicted or lost on its way: the decode instance has no
            # media to encode it from; the raw media let it (nothing lost)
            await up.release()
            m.raw_retries.inc()
            logger.warning("metadata-only request failed rid=%s decoder=%s status=%d "
                           "action=retrying once with the raw media", rid, up.url,
                           up.status_code)
            info["metadata_only"] = 0
            body = raw
            up = await self._open("/v1/chat/completions", _json_encode(body), rid, key=key)
        elif n_meta:
            m.items_metadata_only.inc(n_meta)
        return up, info, body

    def _placeholders(self, hints: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Placeholder metadata of the hinted items (from this request's encoders, else
        remembered from an earlier encode); `hints` keep only what decode instances read."""
        out: dict[str, dict[str, Any]] = {}
        for item_id, entry in hints.items():
            meta = placeholder_metadata(entry)
            if meta is not None:
                hints[item_id] = {k: v for k, v in entry.items() if k != "metadata"}
                self._metadata[item_id] = meta
                self._metadata.move_to_end(item_id)
                if len(self._metadata) > _MAX_REMEMBERED:
                    self._metadata.popitem(last=False)
            else:
                meta = self._metadata.get(item_id)
            if meta is not None:
                out[item_id] = meta
        return out

    async def _open(self, path: str, payload: bytes | None, rid: str,
                    method: str = "POST", key: str | None = None) -> Upstream:
        assert self.decoders is not None
        try:
            up = await self.decoders.open(method, path, payload, rid, key=key)
        except GatewayError:
            self.metrics.upstream_errors.labels("decode").inc()
            raise
        if up.retries:
            self.metrics.retries.labels("decode").inc(up.retries)
            self.metrics.upstream_errors.labels("decode").inc(up.retries)
        return up

    async def _relay(self, up: Upstream, scope: Scope, receive: Receive, send: Send, rid: str,
                     t0: float, endpoint: str, stream: bool, info: dict[str, Any],
                     watch: _Watch, on_first: Any = None, resume: Any = None,
                     wants_ids: bool = False) -> None:
        """Pass the upstream answer through, closing `up` on every path (cancelled by `watch`
        on a client disconnect: the upstream connection is closed, vLLM aborts the request).
        `on_first()` runs once the first answer bytes are in (the decode has prefilled).
        `resume(tracker, failed_url)`: a stream that breaks off continues on another
        instance when it can (failover.py); a non-streamed answer that breaks off is asked
        again elsewhere (the client has seen nothing)."""
        headers = [(b"x-request-id", rid.encode())]
        ctype = up.content_type
        if ctype:
            headers.append((b"content-type", ctype.encode()))
        first: float | None = None
        status = up.status_code
        m = self.metrics
        try:
            if not stream:
                for attempt in range(2):
                    try:
                        data = await asyncio.wait_for(up.read(), self.cfg.timeouts.decode_s)
                        break
                    except asyncio.TimeoutError:
                        raise GatewayError(504, "the prefill/decode instance did not answer "
                                           "in time", "decode_timeout") from None
                    except UpstreamError as exc:
                        m.upstream_errors.labels("decode").inc()
                        again = (await resume(None, up.url)
                                 if resume is not None and attempt == 0 else None)
                        if again is None:
                            raise GatewayError(502, f"the prefill/decode instance {up.url} "
                                               f"broke off its answer ({exc})",
                                               "decode_broke") from None
                        m.failovers.labels("resumed").inc()  # the client saw nothing yet
                        logger.warning("decode answer broke rid=%s decoder=%s error=%s "
                                       "action=asked %s again", rid, up.url, exc, again[0].url)
                        await up.release()
                        up = again[0]
                        info["failover"] = up.url
                first = time.perf_counter()
                if on_first is not None:
                    on_first()
                headers.append((b"content-length", str(len(data)).encode()))
                watch.finish()
                await send({"type": "http.response.start", "status": status,
                            "headers": headers})
                await send({"type": "http.response.body", "body": data})
            else:
                await send({"type": "http.response.start", "status": status,
                            "headers": headers})
                tracker = StreamTracker(wants_ids) if resume is not None else None
                chunks = up.chunks().__aiter__()
                while True:
                    try:
                        async for chunk in chunks:
                            if first is None:
                                first = time.perf_counter()
                                if on_first is not None:
                                    on_first()
                            if tracker is not None:
                                chunk = tracker.feed(chunk)
                                if not chunk:
                                    continue
                            await send({"type": "http.response.body", "body": chunk,
                                        "more_body": True})
                        watch.finish()
                        await send({"type": "http.response.body", "body": b""})
                        break
                    except (UpstreamError, ResumeMismatch) as exc:
                        m.upstream_errors.labels("decode").inc()
                        again = (await resume(tracker, up.url)
                                 if tracker is not None and "failover" not in info else None)
                        if again is not None:
                            m.failovers.labels("resumed").inc()
                            logger.warning("decode stream broke rid=%s decoder=%s error=%s "
                                           "action=resumed on %s after %d tokens", rid, up.url,
                                           exc, again[0].url, len(tracker.token_ids))
                            await up.release()
                            up, chunks, head = again
                            info["failover"] = up.url  # the resumer set the tracker
                            data = tracker.feed(head)
                            if data:
                                await send({"type": "http.response.body", "body": data,
                                            "more_body": True})
                            continue
                        if tracker is not None:
                            m.failovers.labels("refused").inc()
                        watch.finish()
                        logger.warning("decode stream broke rid=%s decoder=%s error=%s", rid,
                                       up.url, exc)
                        status = 502
                        err = GatewayError(502, "the prefill/decode instance broke off "
                                           f"the stream ({exc})", "decode_broke").body()
                        await send({"type": "http.response.body",  # tell, not a silent cut
                                    "body": b"data: " + _json_encode(err) + b"\n\n"})
                        break
        except OSError:  # the ASGI server reports a vanished client this way
            watch.finish()
            self._client_gone(rid)
            return
        finally:
            await up.release()
        total = time.perf_counter() - t0
        if first is not None:
            m.stage_first_token.observe(first - up.sent_at)
        m.stage_total.observe(total)
        m.requests.labels(endpoint, str(status)).inc()
        if logger.isEnabledFor(logging.INFO):
            logger.info("request rid=%s endpoint=%s status=%d stream=%s decoder=%s "
                        "dec_retries=%d %s first_token_ms=%s total_ms=%s", rid, endpoint,
                        status, stream, up.url, up.retries,
                        " ".join(f"{k}={v}" for k, v in info.items()),
                        _ms(None if first is None else first - up.sent_at), _ms(total))

    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        rid = _request_id(request)
        t0 = time.perf_counter()
        refused = self._admit()
        if refused is not None:
            await self._error(refused, "completions", rid)(scope, receive, send)
            return
        try:
            await self._completions(request, rid, t0, scope, receive, send)
        finally:
            self._active -= 1

    async def _completions(self, request: Request, rid: str, t0: float, scope: Scope,
                           receive: Receive, send: Send) -> None:
        try:
            body = await self._read_json(request)
            if not isinstance(body, dict):
                raise GatewayError(400, "request body must be a JSON object")
            model = body.setdefault("model", self.cfg.model)
            if model != self.cfg.model:
                raise GatewayError(404, f"model {model!r} is not served here; this gateway "
                                   f"serves {self.cfg.model!r}", "unknown_model")
            body.pop("ec_transfer_params", None)
            payload = _json_encode(body)
        except GatewayError as exc:
            await self._error(exc, "completions", rid)(scope, receive, send)
            return
        except ClientDisconnect:
            self._client_gone(rid)
            return
        watch = _Watch(receive)

        async def answer() -> None:
            up = await self._open("/v1/completions", payload, rid)
            await self._relay(up, scope, receive, send, rid, t0, "completions",
                              body.get("stream") is True, {}, watch)

        await self._guarded(answer, watch, "completions", rid, scope, receive, send)

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = _request_id(Request(scope, receive))
        try:
            up = await self._open("/v1/models", None, rid, method="GET")
        except GatewayError as exc:
            await self._error(exc, "models", rid)(scope, receive, send)
            return
        watch = _Watch(receive)
        try:
            await self._relay(up, scope, receive, send, rid, time.perf_counter(), "models",
                              False, {}, watch)
        finally:
            watch.finish()

    async def health(self, request: Request) -> JSONResponse:
        """200 when at least one prefill/decode instance is healthy (encoders are optional:
        without them requests still succeed, encoded locally)."""
        assert self.client is not None
        timeout = self.cfg.timeouts.health_s

        async def probe(url: str) -> bool:
            try:
                r = await self.client.get(url + "/health", timeout=timeout)
                return r.status_code == 200
            except httpx.HTTPError:
                return False

        assert self.decoders is not None and self.router is not None
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
        """Each encoder and decode instance: state (up, cooling_down, draining), in flight,
        and what it was given (decoders: `affinity` = requests that went to their first
        item's own instance)."""
        assert self.decoders is not None and self.router is not None
        probes = self.prober.results if self.prober is not None else {}
        out = {"encoders": self.router.describe(), "decoders": self.decoders.describe(),
               "routing": self.cfg.routing.model_dump()}
        for entry in (*out["encoders"], *out["decoders"]):
            if entry["url"] in probes:
                entry["probe"] = probes[entry["url"]].describe()
        return JSONResponse(out)

    def _admin_allowed(self, request: Request) -> bool:
        if self._admin_token is not None:
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            return hmac.compare_digest(given.encode(), self._admin_token.encode())
        client = request.client
        return client is not None and is_loopback(client.host)

    async def admin_instances(self, request: Request) -> JSONResponse:
        """POST {"role": "encoder"|"decoder", "url": BASE_URL, "action": "add"|"remove",
        "drain_timeout_s": 60}: join or leave at run time. A removed instance gets nothing new
        and is forgotten once its requests in flight are done (or the timeout passed)."""
        assert self.decoders is not None and self.router is not None
        if not self.cfg.routing.admin:
            return JSONResponse({"error": "admin endpoints are off (routing.admin)"}, 404)
        if not self._admin_allowed(request):
            return JSONResponse({"error": "admin endpoints need the deployment's admin token "
                                 "(`epd admin-token`) as a Bearer token; without a secret, "
                                 "loopback callers only"}, 403)
        try:
            change = AdminChange.model_validate(await self._read_json(request))
        except GatewayError as exc:
            return JSONResponse(exc.body(), exc.status)
        except ValueError as exc:
            return JSONResponse({"error": f"bad admin request: {exc}"}, 400)
        url = change.url
        if change.action == "add":
            if change.role == "encoder":
                self.router.add(self._encoder_client(url))
            else:
                self.decoders.add(url)
            logger.info("instance joined role=%s url=%s", change.role, url)
            return JSONResponse({"url": url, "role": change.role, "state": "up"})
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

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)


class _Endpoint:
    """A raw ASGI endpoint (Starlette calls it with scope/receive/send)."""

    def __init__(self, fn: Any) -> None:
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
