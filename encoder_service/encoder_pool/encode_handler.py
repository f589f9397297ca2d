"""The pool's POST /encode handler: admission, item checks, decode, encode, publish, answer.

One `EncodeHandler` per app (server.py makes it): it refuses at the door what the pool
cannot take (ids, sizes, a full queue or budget), decodes the items vLLM's way, submits them
to the batching pool, publishes finished embeddings through the transport and answers with
every item's status and the `ec_transfer_params` of those published.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ec_connectors.protocol.http_api import UPSTREAM_ERROR, error_type
from ec_connectors.protocol.keys import MAX_ID_BYTES, InvalidItemId, item_key
from ec_connectors.protocol.stored import ItemInfo
from encoder_service.encoder_pool.batching import EncoderPool
from encoder_service.encoder_pool.config import PoolConfig
from encoder_service.encoder_pool.jobs import QUEUE_FULL, ItemFailed, Overloaded
from encoder_service.encoder_pool.lifecycle import BudgetExceeded
from encoder_service.encoder_pool.media import (
    BadMedia,
    MediaItem,
    decode_audio,
    decode_image,
    decode_video,
    payload_bytes,
)
from encoder_service.encoder_pool.publish import MAX_REMEMBERED, Publisher
from epd_common.lru import BoundedLRU


class EncodeItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=MAX_ID_BYTES)
    modality: str = "image"
    data: str = Field(min_length=1)


class EncodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[EncodeItem] = Field(min_length=1)
    timeout_s: float | None = Field(default=None, gt=0, le=3600)
    keep: bool = False
    on_failure: Literal["text_only", "fail"] | None = None


class ReleaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    item_ids: list[str] = Field(min_length=1, max_length=4096)
    keep: bool | None = None


def _error(status: int, code: str, message: str, retry_after: float | None = None,
           **extra: Any) -> JSONResponse:
    """A refusal in OpenAI's error shape with its machine-readable `code` (docs/errors.md)."""
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    return JSONResponse({"error": {"message": message,
                                   "type": error_type(status, UPSTREAM_ERROR), "code": code},
                         **extra}, status_code=status,
                        headers=headers)


async def invalid_request(_request: Any, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 for a body that breaks the schema, as a 400 in the same shape."""
    where = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}"
                      for e in exc.errors()[:5])
    return _error(400, "invalid_request", f"bad encode request: {where}")


class _Refused(Exception):
    """A step of EncodeHandler refused the request with `response` (the whole request)."""

    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


class EncodeHandler:
    """The handler of POST /v1/encode, one method per step.

    POST /v1/encode in steps: `door` (limits, ids, signatures, media decoded and prepared
    by vLLM's processor), `admit` (queue room, all or nothing), `submit` (to the batcher),
    `publish` (each item once encoded, through the transport) and `answer` (per-item status,
    `ec_transfer_params`, the failure policy). A step that refuses the whole request raises
    _Refused; `failures` collects what fails item by item."""

    def __init__(self, config: PoolConfig, pool: EncoderPool, publisher: Publisher,
                 signer: Any) -> None:
        self.config, self.pool, self.publisher, self.signer = config, pool, publisher, signer
        self.encoder = pool.workers[0].encoder  # preprocessing is the same on every device
        # picks vLLM's video loader
        self.video_processor = getattr(self.encoder, "video_processor", None)
        self._answered: BoundedLRU[str, MediaItem] = BoundedLRU(MAX_REMEMBERED)

    async def __call__(self, req: EncodeRequest) -> JSONResponse:
        policy = req.on_failure or self.config.on_failure
        timeout = req.timeout_s or self.config.item_timeout_s
        try:
            self._check_ids(req)
            stored = await asyncio.to_thread(self._stored, self._answered_before(req))
            self.pool.stats.reuse_hits += len(stored)
            items, bad = await self.door(req, policy, skip=stored)
            self.admit(items)
            futures = self.submit(items, timeout, req.keep)
        except _Refused as refused:
            return refused.response
        failures = {k: ("bad_media", e.reason) for k, e in bad.items()}
        infos = {k: info for k, (_, info) in stored.items()}
        infos.update(await self.publish(futures, timeout, failures))
        return self.answer([it.id for it in req.items],
                           [*items, *(it for it, _ in stored.values())], infos, failures, policy)

    # -- the steps ---------------------------------------------------------------------------
    async def door(self, req: EncodeRequest, policy: str, skip: dict | None = None
                   ) -> tuple[list[MediaItem], dict[str, BadMedia]]:
        """Decode and prepare a request's items, refusing bad media item by item.

        The request's items decoded and prepared (but those in `skip`), and the media
        refused item by item (under on_failure=fail, any of those refuses the request)."""
        items, bad = await asyncio.to_thread(self._decode, req, skip or {})
        if bad and policy == "fail":
            raise _Refused(_error(400, "bad_media", "; ".join(str(e) for e in bad.values()),
                                  items={k: e.reason for k, e in bad.items()}))
        return items, bad

    def _check_ids(self, req: EncodeRequest) -> None:
        if len(req.items) > self.config.max_items_per_request:
            raise _Refused(_error(400, "too_many_items", f"{len(req.items)} items; the limit "
                                  f"is {self.config.max_items_per_request}"))
        ids = [it.id for it in req.items]
        if len(set(ids)) != len(ids):
            raise _Refused(_error(400, "duplicate_ids",
                                  "item ids must be unique within a request"))
        for item_id in ids:
            try:
                item_key(item_id)
            except InvalidItemId as exc:
                raise _Refused(_error(400, "bad_item_id", f"bad item id: {exc}")) from None
            if not self.signer.vouched(item_id):  # we publish: never under a client's name
                raise _Refused(_error(403, "unsigned_id", f"item id {item_id[:80]!r} is not "
                                      "signed with the deployment secret (the gateway signs "
                                      "the ids it derives)"))

    def _decode(self, req: EncodeRequest, skip: dict
                ) -> tuple[list[MediaItem], dict[str, BadMedia]]:
        """Decode and preprocess a request's items (runs in a thread).

        Runs in a thread: decoding and vLLM's preprocessing take milliseconds per item
        (a long video: hundreds)."""
        config, modalities = self.config, self.pool.modalities
        items, bad = [], {}
        for it in req.items:
            if it.id in skip:
                continue
            try:
                if it.modality not in modalities:
                    raise BadMedia(it.id, f"modality {it.modality!r} is not served "
                                          f"(served: {', '.join(modalities)})")
                if it.modality == "video":
                    item = decode_video(it.id, it.data, config.max_media_bytes,
                                        config.max_image_pixels, self.video_processor,
                                        config.media_io_kwargs)
                else:
                    raw = payload_bytes(it.id, it.data, config.max_media_bytes)
                    item = (decode_audio(it.id, raw) if it.modality == "audio" else
                            decode_image(it.id, raw, config.max_image_pixels))
                items.append(self.encoder.prepare(item))  # vLLM's processor: exact token count
            except BadMedia as exc:
                bad[it.id] = exc
        return items, bad

    def _answered_before(self, req: EncodeRequest) -> dict[str, MediaItem]:
        """The request's items this pool already published and answered.

        The request's items this pool published and answered before (event loop: the
        table is the loop's)."""
        out = {}
        for it in req.items:
            known = self._answered.get(it.id)
            if known is not None and known.modality == it.modality:
                out[it.id] = known
        return out

    def _stored(self, known: dict[str, MediaItem]) -> dict[str, tuple[MediaItem, ItemInfo]]:
        """Pick the already answered items the transport still holds.

        Of `known`, those the transport still holds: answered again without decoding or
        encoding (a transport the gateway cannot see into, shm or the store, sends every
        repeat here; ids are the gateway's signed content ids, so the same id is the same
        media and settings). Runs in a thread (may touch the medium)."""
        out = {}
        for item_id, item in known.items():
            info = self.publisher.stored(item_id)
            if info is not None:
                out[item_id] = (item, info)
        return out

    def admit(self, items: list[MediaItem]) -> None:
        """All or nothing for the queue: every modality's queue must hold its items."""
        need: dict[str, int] = {}
        for it in items:  # a chunked video takes a slot per chunk
            need[it.modality] = need.get(it.modality, 0) + self.pool.slots(it)
        for modality, n in need.items():
            if self.pool.free_slots(modality) < n:
                self.pool.stats.reject(QUEUE_FULL)
                raise _Refused(_error(429, "queue_full", f"{modality} queue is full; retry "
                                      "later", self.config.retry_after_s))

    def submit(self, items: list[MediaItem], timeout: float, keep: bool
               ) -> dict[str, asyncio.Future]:
        """Each item to the batcher; budget refusals stop the rest."""
        futures = {}
        try:
            for it in items:
                futures[it.item_id] = self.pool.submit(it, timeout, keep=keep)
        except Overloaded as exc:
            raise _Refused(_error(429, "overloaded", str(exc), exc.retry_after_s)) from None
        except BudgetExceeded as exc:
            raise _Refused(_error(503, "over_budget", f"encoder memory budget is full: {exc}",
                                  self.config.retry_after_s)) from None
        return futures

    async def publish(self, futures: dict[str, asyncio.Future], timeout: float,
                      failures: dict[str, tuple[str, str]]) -> dict[str, ItemInfo]:
        """Publish each item through the transport once encoded.

        Each item through the transport once encoded (pinned meanwhile, so the store
        cannot drop it); what fails lands in `failures` as (code, reason)."""
        results = await asyncio.gather(*(self._publish_one(k, f, timeout)
                                         for k, f in futures.items()), return_exceptions=True)
        infos = {}
        for item_id, res in zip(futures, results, strict=True):
            if isinstance(res, ItemFailed):
                failures[item_id] = (res.code, res.reason)
            elif isinstance(res, BaseException):
                failures[item_id] = ("publish_error", repr(res))
            else:
                infos[item_id] = res
        return infos

    async def _publish_one(self, item_id: str, fut: asyncio.Future, timeout: float
                           ) -> ItemInfo:
        try:
            tensor = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise ItemFailed(item_id, "timeout", f"not encoded within {timeout:.3g} s"
                             ) from None
        self.pool.store.pin(item_id)
        try:
            return await self.publisher.publish(item_id, tensor)
        finally:
            self.pool.store.unpin(item_id)

    def answer(self, ids: list[str], items: list[MediaItem], infos: dict[str, ItemInfo],
               failures: dict[str, tuple[str, str]], policy: str) -> JSONResponse:
        """Build the encode response: every item's status and transfer params.

        200 with every item's status and the `ec_transfer_params` of those published;
        under on_failure=fail, any failure makes it a 500 (a 504 when all timed out)."""
        params = self.publisher.params(infos)
        describe = self.encoder.placeholder_metadata
        for it in items:  # metadata-only requests to the consumer (Qwen family)
            if it.item_id not in infos:
                continue
            meta = describe(it)
            if meta:
                params.items[it.item_id] = params.items[it.item_id].with_metadata(meta)
            # what a repeat is answered with (`_stored`): the item without its media
            self._answered[it.item_id] = MediaItem(it.item_id, it.modality,
                                                   num_embeds=it.num_embeds,
                                                   metadata=dict(meta or {}))
        out_items: dict[str, Any] = {}
        for item_id in ids:
            if item_id in infos:
                out_items[item_id] = {"status": "ok", **params.items[item_id].to_dict()}
            else:
                code, reason = failures[item_id]
                out_items[item_id] = {"status": "failed", "code": code, "error": reason}
        if failures and policy == "fail":
            status = 504 if all(c == "timeout" for c, _ in failures.values()) else 500
            return _error(status, "encode_timeout" if status == 504 else "encode_failed",
                          "; ".join(f"item {k!r}: {r}" for k, (_, r) in failures.items()),
                          items=out_items)
        return JSONResponse({"items": out_items, "ec_transfer_params": params.to_dict(),
                             "fallback": "text_only" if failures else None})
