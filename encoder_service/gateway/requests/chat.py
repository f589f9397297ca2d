"""The chat flow, POST /v1/chat/completions.

The chat flow, POST /v1/chat/completions: validate and tag the media (parsing.py), skip
items already available (availability.py), encode the rest (encoder_clients.py), and open
the request with its ec_transfer_params on a prefill/decode instance (decoders.py), after the
encode or beside it (`routing.overlap`); the answer is relayed (relay.py) with a failover
resumer (resume.py).

Items whose encoders publish placeholder metadata (`image_grid_thw`, ...) go metadata-only:
the decode instance gets the metadata instead of the media and loads the embedding through
its connector; the metadata is remembered, so a later request for an item that is already
available goes metadata-only too. A metadata-only request that fails before its first token
is asked once more with the raw media. Traced (tracing.py, when configured): a span per stage,
and `traceparent` to the encoders and prefill/decode instances."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from ec_connectors.protocol.item_ids import IdSigner
from ec_connectors.protocol.params import ItemEntry, TransferParams
from encoder_service.gateway.config import ChatSection
from encoder_service.gateway.media.parsing import (
    MediaPart,
    PreparedRequest,
    metadata_only_body,
    prepare_chat,
)
from encoder_service.gateway.media.urls import fetch_media
from encoder_service.gateway.requests.admission import Admission, request_id
from encoder_service.gateway.requests.relay import Exchange, Relay, RelayPlan, Watch
from encoder_service.gateway.telemetry.metrics import ENCODER, START, GatewayMetrics
from encoder_service.gateway.telemetry.tracing import RequestTrace, Tracer
from encoder_service.gateway.upstreams.availability import Availability
from encoder_service.gateway.upstreams.decoders import DecodePool, Upstream
from encoder_service.gateway.upstreams.encoder_clients import (
    EncodeOutcome,
    EncoderRouter,
    PoolEncoderClient,
)
from encoder_service.gateway.upstreams.failover import upstream_body
from encoder_service.gateway.upstreams.kv_handoff import KvHandoff
from encoder_service.gateway.upstreams.resume import Resumer
from encoder_service.gateway.wire import GatewayError, json_encode, ms
from epd_common.lru import BoundedLRU

logger = logging.getLogger("epd.gateway")

_MAX_REMEMBERED = 65536  # placeholder metadata of this many items (about 150 B each)
_PROMISED = ItemEntry(pending=True)  # sent before its encode: the decode instance waits

# the decode request, its log fields and the body it was sent
Routed = tuple[Upstream, dict[str, Any], dict[str, Any]]


async def _discard(task: asyncio.Task[Routed]) -> None:
    """Cancel or release a decode request opened early.

    Cancel a decode request opened early; one that opened already is released (closing
    its connection aborts the request in vLLM), even when our own wait is cancelled."""
    task.add_done_callback(_release_routed)
    task.cancel()
    await asyncio.wait([task])  # never raises the task's error; our own cancellation does


def _release_routed(task: asyncio.Task[Routed]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result()[0].close()


class ChatFlow:
    """The chat endpoint over the gateway's parts.

    The chat endpoint over the gateway's parts (made at start-up, once the upstream
    clients exist); `drain()` at shutdown waits for the encoder releases in flight."""

    def __init__(self, section: ChatSection, metrics: GatewayMetrics,
                 availability: Availability, ids: IdSigner, router: EncoderRouter,
                 decoders: DecodePool, fetch_client: httpx.AsyncClient, admission: Admission,
                 relay: Relay, kv: KvHandoff | None = None,
                 tracer: Tracer | None = None) -> None:
        self.section = section
        self.tracer = tracer  # None: tracing off (tracing.py)
        self.kv = kv  # E/P/D: the prefill hop before each decode request (kv_handoff.py)
        self.metrics = metrics
        self.availability = availability
        self.ids = ids  # signs the item ids it derives (with the deployment secret)
        self.router = router
        self.decoders = decoders
        self.fetch_client = fetch_client
        self.admission = admission
        self.relay = relay
        self.resumer = Resumer(decoders, section.rules.model, section.decode_s,
                               kv.pool if kv is not None else None, metrics)
        self._background: set[asyncio.Task] = set()  # releases in flight (strong refs)
        # item id -> placeholder metadata its encoder published: a later request for an
        # item that is already available goes metadata-only too
        self._metadata: BoundedLRU[str, dict[str, Any]] = BoundedLRU(_MAX_REMEMBERED)
        # modality -> whether its encoders' last answer carried placeholder metadata
        self._publishes_metadata: dict[str, bool] = {}

    async def drain(self, timeout_s: float) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)

    def _release(self, outcome: EncodeOutcome | None) -> None:
        """Release an outcome's items on their encoders, in the background.

        Tell the encoders holding `outcome`'s items that the decode side is done with
        them (in the background; once per outcome)."""
        if outcome is not None and outcome.holders:
            task = asyncio.ensure_future(outcome.release())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _fetch(self, url: str) -> tuple[bytes, str | None]:
        rules = self.section.rules
        return await fetch_media(self.fetch_client, url, rules.media, rules.limits)

    # -- the endpoint ------------------------------------------------------------------------
    async def chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.tracer is None:
            await self._admit(scope, receive, send, None)
            return
        trace = self.tracer.start(scope)
        try:
            await self._admit(scope, receive, trace.watch(send), trace)
        finally:
            trace.finish()

    async def _admit(self, scope: Scope, receive: Receive, send: Send,
                     trace: RequestTrace | None) -> None:
        request = Request(scope, receive)
        rid = request_id(request)
        t0 = time.perf_counter()
        if trace is not None:
            trace.attrs["epd.request_id"] = rid
        refused = self.admission.admit()
        if refused is not None:
            await self.relay.error(refused, "chat", rid)(scope, receive, send)
            return
        self.metrics.inflight.inc()
        try:
            await self._chat(request, rid, t0, scope, receive, send, trace)
        finally:
            self.metrics.inflight.dec()
            self.admission.leave()

    async def _chat(self, request: Request, rid: str, t0: float, scope: Scope,
                    receive: Receive, send: Send, trace: RequestTrace | None) -> None:
        try:
            body = await self.admission.read_json(request)
            prepared = await prepare_chat(body, self.section.rules, self._fetch, self.ids)
        except GatewayError as exc:
            await self.relay.error(exc, "chat", rid)(scope, receive, send)
            return
        except ClientDisconnect:  # gone while uploading: nothing was sent upstream
            self.relay.client_gone(rid)
            return
        t_parse = time.perf_counter() - t0
        self.metrics.stage_parse.observe(t_parse)
        if trace is not None:
            trace.add("epd.parse", t0, t0 + t_parse)
        ex = Exchange(scope, receive, send, rid, t0, "chat", Watch(receive))
        held: list[EncodeOutcome] = []  # encoded items to release after the first token

        def release() -> None:
            self._release(held[0] if held else None)  # once: no-op when released

        wants_ids = prepared.body.get("return_token_ids") is True  # before routing adds it
        options = prepared.body.get("stream_options")
        wants_usage = isinstance(options, dict) and options.get("include_usage") is True

        async def answer() -> None:
            up, info, sent = await self._route(prepared, rid, held, trace)
            info["parse_ms"] = ms(t_parse)
            if trace is not None:
                trace.decoding()  # a failover's requests join the decode span
            resume = self.resumer.bound(sent, rid) if self.section.routing.failover else None
            await self.relay.relay(up, ex, prepared.stream, info,
                                   RelayPlan(on_first=release, resume=resume,
                                             wants_ids=wants_ids, wants_usage=wants_usage,
                                             trace=trace))

        try:
            await self.relay.guarded(answer, ex)
        finally:
            release()

    # -- routing: encode what is missing, open the decode request ----------------------------
    async def _route(self, prepared: PreparedRequest, rid: str, held: list[EncodeOutcome],
                     trace: RequestTrace | None) -> Routed:
        """Encode what is missing and open the decode request.

        Encode what is missing (the outcome is appended to `held`) and open the decode
        request, after the encode or beside it (`_overlaps`); returns the decode request, the
        log fields and the body it was sent."""
        t_items = time.perf_counter()  # the trace's `epd.items` (lookups included)
        ids = [it.item_id for it in prepared.items]
        hits = self.availability.available(ids) if ids else set()
        todo = [it for it in prepared.items if it.item_id not in hits]
        hints: dict[str, ItemEntry] = {i: self.availability.hint(i) for i in hits}
        info: dict[str, Any] = {"items": len(ids), "hits": len(hits), "encoded": 0,
                                "fallback": 0, "enc_retries": 0, "overlap": 0}
        key = ids[0] if ids else None  # its decode instance: where its first item went before
        if hits:
            self.metrics.items_hit.inc(len(hits))
        if not todo:
            if trace is not None and ids:
                trace.items(trace.begin_items(), t_items, prepared.items, hits)
            return await self._open_decode(prepared, hints, rid, key, info, trace)
        t = time.perf_counter()
        early: asyncio.Task[Routed] | None = None
        if self._overlaps(todo):
            # The decode instance gets the request now, its new items marked pending: it
            # renders and preprocesses while they are encoded, then waits for them to land.
            pending = {**hints, **{it.item_id: _PROMISED for it in todo}}
            early = asyncio.ensure_future(self._open_decode(prepared, pending, rid, key, info,
                                                            trace))
        items_span = trace.begin_items() if trace is not None else 0  # encoder calls' parent
        try:
            outcome, errors = await self.router.encode(todo, rid)
        except BaseException:
            if early is not None:
                await _discard(early)
            raise
        held.append(outcome)
        if trace is not None:
            trace.items(items_span, t_items, prepared.items, hits, outcome,
                        self.router.made_by, early is not None)
        self._count_encode(outcome, errors, rid, info, time.perf_counter() - t)
        for it in todo:  # what the encoders publish, learned from each answer (failed: none)
            hint = outcome.hints.get(it.item_id)
            if hint is not None:
                self._publishes_metadata[it.modality] = hint.metadata is not None
        hints.update(outcome.hints)
        if early is not None:
            if not outcome.failed:
                info["overlap"] = len(todo)
                self.metrics.items_overlapped.inc(len(todo))
                return await early
            # An item that will not land: ask again without its promise (it goes raw and
            # the decode instance encodes it) instead of letting the instance wait for it.
            await _discard(early)
        return await self._open_decode(prepared, hints, rid, key, info, trace)

    def _overlaps(self, todo: list[MediaPart]) -> bool:
        """Whether these new items go to the decode instance before they are encoded."""
        mode = self.section.routing.overlap
        if mode != "auto":
            return mode == "on"
        if self.availability.name == "none":
            return False
        if self.section.encoder_backend == "pool" and not all(map(PoolEncoderClient.takes, todo)):
            return False  # the pool sends it back: the early request would be thrown away
        # Only modalities whose encoders were seen to publish no placeholder metadata (the
        # decode instance needs their media anyway, e.g. LLaVA). The others wait for it and
        # go metadata-only: no media for the decode instance to decode and preprocess.
        return not self.section.rules.media.metadata_only or all(
            self._publishes_metadata.get(it.modality) is False for it in todo)

    def _count_encode(self, outcome: EncodeOutcome, errors: list[str], rid: str,
                      info: dict[str, Any], seconds: float) -> None:
        m = self.metrics
        m.stage_encode.observe(seconds)
        info["encode_ms"] = ms(seconds)
        info.update(encoded=len(outcome.hints) - outcome.shared, shared=outcome.shared,
                    fallback=len(outcome.failed), enc_retries=outcome.retries)
        m.items_encoded.inc(len(outcome.hints) - outcome.shared)
        if outcome.shared:
            m.items_shared.inc(outcome.shared)
        if outcome.retries:
            m.retries.labels(ENCODER).inc(outcome.retries)
        if errors:
            m.upstream_errors.labels(ENCODER).inc(len(errors))
        if outcome.failed:
            m.items.labels("fallback").inc(len(outcome.failed))
            m.fallbacks.inc()
            logger.warning("encoder failure rid=%s items=%d errors=%s action=sending raw "
                           "media (decode instance encodes locally)", rid,
                           len(outcome.failed), errors)
        elif errors:
            logger.warning("encoder retry rid=%s errors=%s action=retried on another "
                           "encoder, succeeded", rid, errors)

    async def _open_decode(self, prepared: PreparedRequest, hints: dict[str, ItemEntry],
                           rid: str, key: str | None, info: dict[str, Any],
                           trace: RequestTrace | None = None) -> Routed:
        """Open the decode request, falling back to raw media if that fails early.

        Open the decode request: `prepared.body` with `hints` as its ec_transfer_params,
        metadata-only parts where the items' metadata is known (once again with the raw media
        if that fails before the answer). `prepared.body` itself is left as it is."""
        raw = dict(prepared.body)
        raw.pop("ec_transfer_params", None)
        metadata = self._placeholders(hints)
        if hints:
            raw["ec_transfer_params"] = TransferParams(items=hints).to_dict()
        body, n_meta = (metadata_only_body(raw, metadata)
                        if metadata and self.section.rules.media.metadata_only else (raw, 0))
        info["metadata_only"] = n_meta
        if prepared.stream and self.section.routing.failover:  # token ids: a break can resume
            body, raw = upstream_body(body), upstream_body(raw)
        up = await self._decode(body, rid, key, info, trace)
        try:
            failed = n_meta > 0 and await up.failed_before_answer(prepared.stream)
        except BaseException:  # the client left meanwhile: nobody else will release it
            await up.release()
            raise
        if failed:
            # e.g. an embedding evicted or lost on its way: the decode instance has no
            # media to encode it from; the raw media let it (nothing lost)
            await up.release()
            self.metrics.raw_retries.inc()
            logger.warning("metadata-only request failed rid=%s decoder=%s status=%d "
                           "action=retrying once with the raw media", rid, up.url,
                           up.status_code)
            info["metadata_only"] = 0
            body = raw
            up = await self._decode(body, rid, key, info, trace)
        elif n_meta:
            self.metrics.items_metadata_only.inc(n_meta)
        return up, info, body

    async def _decode(self, body: dict[str, Any], rid: str, key: str | None,
                      info: dict[str, Any], trace: RequestTrace | None = None) -> Upstream:
        """Send a request body to a decode instance, prefilled first under E/P/D.

        Open `body` on a decode instance (by `key`'s affinity); E/P/D: prefilled first on
        a prefill instance (by `key`), then on a decode instance by load with the prefill's
        kv_transfer_params (none when the handoff failed: it computes the prompt). `body`
        itself stays without them: a failover resumes on another instance from scratch.
        Traced: an `epd.prefill` and an `epd.decode` span, each request's traceparent."""
        sent, decode_key = body, key
        if self.kv is not None:
            span = trace.open_call("epd.prefill") if trace is not None else None
            params = await self.kv.prefill(body, rid, key, info)
            if span is not None:
                span.done(**{"epd.kv_handoff": str(info.get("kv_handoff", ""))})
            if params is not None:
                sent = {**body, "kv_transfer_params": params}
            decode_key = None
        span = trace.open_decode() if trace is not None else None
        try:
            up = await self.decoders.request("POST", "/v1/chat/completions",
                                             json_encode(sent), rid, key=decode_key)
        except GatewayError:
            if self.kv is None:
                raise
            # no decode instance usable: a prefill instance is a whole vLLM server with the
            # prompt's KV cache in its prefix cache, so it answers the request in full
            logger.warning("no decode instance answered rid=%s action=the prefill instance "
                           "answers in full", rid)
            up = await self.kv.pool.request("POST", "/v1/chat/completions",
                                            json_encode(body), rid, key=key)
            info["decode"] = "prefill"
            self.metrics.prefill_answers.labels(START).inc()
        if span is not None:
            span.attrs.update({"server.address": up.url, "epd.retries": up.retries,
                               "http.response.status_code": up.status_code})
        return up

    def _placeholders(self, hints: dict[str, ItemEntry]) -> dict[str, dict[str, Any]]:
        """The placeholder metadata of the hinted items.

        Placeholder metadata of the hinted items (from this request's encoders, else
        remembered from an earlier encode); `hints` keep only what decode instances read."""
        out: dict[str, dict[str, Any]] = {}
        for item_id, entry in hints.items():
            meta = entry.metadata  # well-formed: TransferParams.parse keeps no other
            if meta is not None:
                hints[item_id] = entry.with_metadata(None)
                self._metadata[item_id] = meta
            else:
                meta = self._metadata.get(item_id)
            if meta is not None:
                out[item_id] = meta
        return out
