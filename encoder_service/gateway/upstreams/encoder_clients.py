"""Encoders behind one small interface, and the router that spreads items over them.

`EncoderClient.encode(items, request_id)` makes the items' embeddings available to decode
instances and returns `{item_id: ItemEntry}` to forward as `ec_transfer_params`; it raises
EncoderFailed on any error or deadline; items it leaves out of the answer failed alone (bad
media for that encoder) and go raw. A client may also be `Releasing` (have
`release(item_ids)`): called once the decode instance is done with the items (first token,
or the request's end).
`VllmEncoderClient` talks to a vLLM ec_producer over HTTP, behind a `CoalescingClient`
(coalescing.py: concurrent requests' new images share calls); `PoolEncoderClient` to the
batching encoder pool (`epd encoder`: `/v1/encode`, `/v1/release`; it batches across calls itself).

`EncoderRouter.encode` sends each item to its encoder (routing.py: the encoder its id hashes
to, unless that one is overloaded), one call per encoder, retries a failed group once on the
next encoder, shares an encode already under way for the same item (single flight), and
reports the items that still failed: the caller sends those as raw media (local encode on the
decode side).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import httpx

from ec_connectors.protocol.params import ItemEntry, TransferParams
from encoder_service.gateway.media.parsing import MediaPart
from encoder_service.gateway.telemetry import tracing
from encoder_service.gateway.upstreams.encoder_progress import EncoderProgress, EncoderSilent
from encoder_service.gateway.upstreams.routing import Chooser, Members
from encoder_service.gateway.wire import json_decode, json_encode
from epd_common.lru import BoundedLRU

_MAX_HOLDERS = 65536  # items whose encoder the router remembers
_UNLISTED = ItemEntry()  # an item an encoder had stored before: the consumer looks it up


class EncoderFailed(Exception):
    """An encode call failed or missed its deadline (`status`: the encoder's HTTP error)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class EncoderClient(Protocol):
    name: str

    async def encode(self, items: Sequence[MediaPart], request_id: str
                     ) -> dict[str, ItemEntry]: ...


@runtime_checkable
class Releasing(Protocol):
    """An EncoderClient that holds items until told the decode side has them."""

    async def release(self, item_ids: Sequence[str]) -> None: ...


async def _post(name: str, client: httpx.AsyncClient, url: str, body: dict[str, Any],
                request_id: str, timeout_s: float, answer_s: float,
                progress: EncoderProgress | None = None) -> httpx.Response:
    """POST with a deadline; every failure (timeout, connection, non-200) is EncoderFailed.

    The deadline: `answer_s` from the start, or with `progress`, its rules (a call queued
    behind others waits while the encoder answers them). Traced (tracing.py): an
    `epd.encoder_call` span, its traceparent sent along."""
    headers = {"x-request-id": request_id, "content-type": "application/json"}
    span = tracing.call("epd.encoder_call", headers, {"server.address": name,
                                                      "epd.request_id": request_id})
    try:
        r = await _answer(name, client, url, body, headers, timeout_s, answer_s, progress)
    except BaseException as exc:
        if span is not None:
            span.failed(exc)
        raise
    if span is not None:
        span.done(**{"http.response.status_code": r.status_code})
    return r


async def _answer(name: str, client: httpx.AsyncClient, url: str, body: dict[str, Any],
                  headers: dict[str, str], timeout_s: float, answer_s: float,
                  progress: EncoderProgress | None) -> httpx.Response:
    # msgspec, not httpx's json.dumps: a video's body encodes faster (docs/benchmarks.md), on the
    # event loop every other request waits on
    call = client.post(url, content=json_encode(body), headers=headers)
    try:
        if progress is None:
            r = await asyncio.wait_for(call, answer_s)
        else:
            r = await progress.within(call)
            progress.answered()
    except asyncio.TimeoutError:
        raise EncoderFailed(f"{name}: no answer within {timeout_s} s") from None
    except EncoderSilent as exc:
        raise EncoderFailed(f"{name}: {exc}") from None
    except httpx.HTTPError as exc:
        raise EncoderFailed(f"{name}: {type(exc).__name__}: {exc}") from None
    if r.status_code != 200:
        raise EncoderFailed(f"{name}: HTTP {r.status_code}: {r.text[:200]}", r.status_code)
    return r


class VllmEncoderClient:
    """A vLLM server with an ec_producer EPDConnector (or any EC producer).

    One chat request carries all of a group's items; max_tokens=1 (an encoder-only producer
    makes none)."""

    def __init__(self, url: str, model: str, client: httpx.AsyncClient,
                 timeout_s: float) -> None:
        self.name = url
        self.url = url + "/v1/chat/completions"
        self.model = model
        self.client = client
        self.timeout_s = timeout_s
        # its calls queue inside vLLM: a call waits while the encoder answers the ones ahead
        self.progress = EncoderProgress(timeout_s)

    async def encode(self, items: Sequence[MediaPart], request_id: str
                     ) -> dict[str, ItemEntry]:
        content = [*(it.part for it in items), {"type": "text", "text": "."}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": 1, "temperature": 0.0}
        body.update(items[0].kwargs)  # one request's items: the same processor settings
        r = await _post(self.name, self.client, self.url, body, request_id, self.timeout_s,
                        self.timeout_s, self.progress)
        bad: list[str] = []  # malformed entries: those items failed (they go raw)
        try:
            made = TransferParams.parse(json_decode(r.content).get("ec_transfer_params"),
                                        bad_items=bad)
        except (ValueError, AttributeError, TypeError):  # not JSON, not an object, BadParams
            raise EncoderFailed(f"{self.name}: unreadable answer") from None
        # Items the producer did not list were already stored (its dedupe): still hinted.
        return {it.item_id: made.items.get(it.item_id, _UNLISTED) for it in items
                if it.item_id not in bad}


def _payload(item: MediaPart) -> str:
    """The media of a prepared part as the pool takes it: a data: URL or base64."""
    part = item.part
    if part.get("type") == "input_audio":
        return part["input_audio"]["data"]
    return part[part["type"]]["url"]


class PoolEncoderClient:
    """The client of a batching encoder pool (`epd encoder`).

    `POST /v1/encode` with all of a group's items (the pool batches across requests). Items
    the pool reports failed, and modalities it does not serve, are left out of the answer
    (the caller sends them raw). `release()`: the decode side has prefilled the items."""

    modalities = ("image", "video", "audio")  # what `epd encoder` can serve; its model decides

    def __init__(self, url: str, client: httpx.AsyncClient, timeout_s: float) -> None:
        self.name = url
        self.url = url
        self.client = client
        self.timeout_s = timeout_s

    @classmethod
    def takes(cls, item: MediaPart) -> bool:
        """Whether the pool encodes `item` (its own processor settings: others go raw)."""
        return item.modality in cls.modalities and not item.kwargs

    async def encode(self, items: Sequence[MediaPart], request_id: str
                     ) -> dict[str, ItemEntry]:
        todo = [it for it in items if self.takes(it)]
        if not todo:
            return {}
        body = {"items": [{"id": it.item_id, "modality": it.modality, "data": _payload(it)}
                          for it in todo],
                "timeout_s": self.timeout_s, "on_failure": "text_only"}
        # the pool enforces timeout_s per item itself; the extra second is for the reply
        r = await _post(self.name, self.client, self.url + "/v1/encode", body, request_id,
                        self.timeout_s, self.timeout_s + 1.0)
        try:
            answer = json_decode(r.content)
            made = TransferParams.parse(answer["ec_transfer_params"], bad_items=[]).items
            status = {k: v.get("status") for k, v in answer["items"].items()}
        except (ValueError, KeyError, AttributeError, TypeError):  # BadParams: ValueError
            raise EncoderFailed(f"{self.name}: unreadable answer") from None
        # an item not "ok", or whose entry is missing or malformed, failed (it goes raw)
        return {it.item_id: made[it.item_id] for it in todo
                if status.get(it.item_id) == "ok" and it.item_id in made}

    async def release(self, item_ids: Sequence[str]) -> None:
        """Best effort: a lost release only leaves the feature to the pool's LRU eviction."""
        with contextlib.suppress(asyncio.TimeoutError, httpx.HTTPError):
            await asyncio.wait_for(self.client.post(self.url + "/v1/release",
                                                    json={"item_ids": list(item_ids)}),
                                   self.timeout_s)


@dataclass
class EncodeOutcome:
    hints: dict[str, ItemEntry] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    retries: int = 0
    calls: int = 0
    shared: int = 0  # items another request of this gateway encoded for this one
    shared_ids: list[str] = field(default_factory=list)
    # traced requests (tracing.py): item -> when its encode ended (perf_counter)
    landed: dict[str, float] | None = None
    # (client, item ids it encoded) for clients that want `release` once the decode is done
    holders: list[tuple[Releasing, list[str]]] = field(default_factory=list)
    router: EncoderRouter | None = None

    async def release(self) -> None:
        """Tell every holding encoder the decode side is done (once; never raises).

        Items other requests still use are released by the last of them."""
        holders, self.holders = self.holders, []
        if self.router is not None:
            holders = self.router.unref(holders)
        if holders:
            await asyncio.gather(*(c.release(ids) for c, ids in holders),
                                 return_exceptions=True)


# (hint, holding client or None); hint None: the item failed (it goes raw)
_Result = tuple[ItemEntry | None, Releasing | None]


class EncoderRouter(Members):
    """Route each item to its encoder, with retries, cool-downs and single flight.

    Each item to its encoder (routing.Chooser: affinity by default), one call per encoder
    per request, a failed call retried once on the item's next encoder, a cool-down for
    encoders that just failed, and single flight: an item already being encoded for another
    request of this gateway is waited for, not encoded again. Encoders join and leave at
    run time (`add`, `drain`)."""

    def __init__(self, clients: Sequence[EncoderClient], cooldown_s: float = 5.0,
                 chooser: Chooser | None = None, single_flight: bool = True) -> None:
        # `chooser`: the routing policy (least loaded when None)
        self.clients: dict[str, EncoderClient] = {c.name: c for c in clients}
        super().__init__(list(self.clients), cooldown_s, {"items": 0, "calls": 0,
                                                          "failures": 0})
        self.chooser = chooser or Chooser("least_loaded", 1.25)
        self.single_flight = single_flight
        self._flights: dict[str, asyncio.Future[_Result]] = {}
        # item -> the encoder that last made it (it holds it now, most likely): preferred
        # over the hash, whatever its load, since serving from memory is cheap
        self._holders: BoundedLRU[str, str] = BoundedLRU(_MAX_HOLDERS)
        self._refs: dict[tuple[str, str], int] = {}  # (encoder, item) -> outcomes holding it

    # -- membership --------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.clients)

    def add(self, client: EncoderClient) -> None:
        self.clients[client.name] = client
        self._join(client.name)

    def _forget(self, name: str) -> None:
        self.clients.pop(name, None)

    # -- choice ------------------------------------------------------------------------------
    def candidates(self, key: str | None = None, exclude: Set[str] = frozenset(),
                   load: dict[str, int] | None = None) -> list[EncoderClient]:
        """Usable encoders for `key`, best first.

        If all are cooling down, they are all tried anyway rather than none; draining and down
        ones never (none: the items go raw)."""
        now = time.monotonic()
        pool = [n for n in self.clients if n not in exclude and self.usable(n)]
        up = [n for n in pool if self.down_until[n] <= now] or pool
        return [self.clients[n] for n in self.chooser.order(key, up, load or self.inflight)]

    async def _call(self, client: EncoderClient, items: Sequence[MediaPart],
                    request_id: str, reserved: bool = False) -> dict[str, ItemEntry]:
        """One encode call; `reserved`: its in-flight count was taken when it was chosen."""
        name = client.name
        if not reserved:
            self.inflight[name] += 1
        self.counts[name]["calls"] += 1
        self.counts[name]["items"] += len(items)
        try:
            out = await client.encode(items, request_id)
        except EncoderFailed:
            self.cool_down(name)
            self.counts[name]["failures"] += 1
            raise
        finally:
            self.inflight[name] -= 1
        self.down_until[name] = 0.0
        return out

    async def _group(self, first: EncoderClient, items: Sequence[MediaPart], request_id: str,
                     outcome: EncodeOutcome, errors: list[str],
                     results: dict[str, _Result]) -> None:
        tried = {first.name}
        client: EncoderClient | None = first
        for attempt in range(2):
            assert client is not None
            outcome.calls += 1
            try:
                made = await self._call(client, items, f"{request_id}-enc{attempt}",
                                        reserved=attempt == 0)
            except EncoderFailed as exc:
                errors.append(str(exc))
                answered_5xx = exc.status is not None and exc.status >= 500
            else:
                holder = client if isinstance(client, Releasing) else None
                for it in items:
                    if it.item_id in made:
                        self._holders[it.item_id] = client.name
                    results[it.item_id] = (made[it.item_id], holder) if it.item_id in made \
                        else (None, None)
                missing = [it.item_id for it in items if it.item_id not in made]
                if missing:  # failed alone (bad for this encoder): raw
                    errors.append(f"{client.name}: {len(missing)} item(s) not encoded")
                return
            others = self.candidates(items[0].item_id, exclude=tried)
            if attempt == 0 and others:
                outcome.retries += 1
                client = others[0]
                tried.add(client.name)
            elif attempt == 0 and answered_5xx:
                # No other encoder, but this one is up and answered an error: once more on
                # it. vLLM answers 500 when its processor caches drift (the API server sent
                # an item without data that EngineCore had evicted); it heals them before
                # answering, and a retry with the data succeeds.
                outcome.retries += 1
            else:
                break
        for it in items:
            results[it.item_id] = (None, None)

    async def _encode_now(self, items: Sequence[MediaPart], request_id: str,
                          outcome: EncodeOutcome, errors: list[str]) -> dict[str, _Result]:
        """Each item to its encoder (grouped: one call per encoder), retries included."""
        load = dict(self.inflight)  # this request's items count too: a big one spreads
        groups: dict[str, list[MediaPart]] = {}
        results: dict[str, _Result] = {}
        for it in items:
            cands = self.candidates(it.item_id, load=load)
            if not cands:  # every encoder is down (restarting) or draining: raw
                results[it.item_id] = (None, None)
                errors.append("no encoder is up")
                continue
            holder = (self._holders.get(it.item_id) if self.chooser.policy == "affinity"
                      else None)
            target = holder if holder is not None and any(
                c.name == holder for c in cands) and self.down_until[holder] <= time.monotonic() \
                else cands[0].name
            load[target] = load.get(target, 0) + 1
            groups.setdefault(target, []).append(it)
        for target in groups:  # counted now: the next request's choice sees these calls
            self.inflight[target] += 1
        await asyncio.gather(*(self._group(self.clients[n], g, request_id, outcome, errors,
                                           results) for n, g in groups.items()))
        return results

    def _take(self, outcome: EncodeOutcome, item_id: str, result: _Result) -> None:
        hint, holder = result
        if hint is None:
            outcome.failed.append(item_id)
            return
        outcome.hints[item_id] = hint
        if holder is not None:
            ref = (holder.name, item_id)  # type: ignore[attr-defined]
            self._refs[ref] = self._refs.get(ref, 0) + 1
            for c, ids in outcome.holders:
                if c is holder:
                    ids.append(item_id)
                    break
            else:
                outcome.holders.append((holder, [item_id]))

    def made_by(self, item_id: str) -> str | None:
        """The encoder that last made `item_id` (None: none of this gateway's encodes)."""
        return self._holders.get(item_id)

    def unref(self, holders: list[tuple[Releasing, list[str]]]
              ) -> list[tuple[Releasing, list[str]]]:
        """What an outcome's release may really release: items no other request holds."""
        out = []
        for client, ids in holders:
            free = []
            for item_id in ids:
                ref = (client.name, item_id)  # type: ignore[attr-defined]
                n = self._refs.get(ref, 1) - 1
                if n <= 0:
                    self._refs.pop(ref, None)
                    free.append(item_id)
                else:
                    self._refs[ref] = n
            if free:
                out.append((client, free))
        return out

    async def encode(self, items: Sequence[MediaPart], request_id: str
                     ) -> tuple[EncodeOutcome, list[str]]:
        """Encode `items`; returns the outcome and the error messages seen."""
        outcome, errors = EncodeOutcome(router=self), []
        if not items:
            return outcome, errors
        if not self.clients:
            outcome.failed = [it.item_id for it in items]
            return outcome, ["no encoders configured"]
        mine: list[MediaPart] = []
        waits: dict[str, asyncio.Future[_Result]] = {}
        for it in items:
            flight = self._flights.get(it.item_id) if self.single_flight else None
            if flight is not None:
                waits[it.item_id] = flight
            elif it.item_id not in waits and all(m.item_id != it.item_id for m in mine):
                mine.append(it)
        if mine:
            loop = asyncio.get_running_loop()
            futures = {it.item_id: loop.create_future() for it in mine}
            if self.single_flight:
                self._flights.update(futures)
            # its own task: a leader whose client goes away still finishes for the others
            task = asyncio.ensure_future(self._encode_now(mine, request_id, outcome, errors))
            task.add_done_callback(lambda t: self._land(futures, t))
            waits.update(futures)
        if tracing.active() is not None:  # traced: each item's span ends when it landed
            outcome.landed = landed = {}
            for item_id, fut in waits.items():
                fut.add_done_callback(lambda _, i=item_id: landed.__setitem__(
                    i, time.perf_counter()))
        try:
            for item_id, fut in waits.items():
                self._take(outcome, item_id, await asyncio.shield(fut))
        except asyncio.CancelledError:  # the client left: this request holds nothing
            self.unref(outcome.holders)
            raise
        # shared: other requests' encodes this one used (one that failed is in `failed`)
        mine_ids = {it.item_id for it in mine}
        outcome.shared_ids = [i for i in waits if i not in mine_ids and i in outcome.hints]
        outcome.shared = len(outcome.shared_ids)
        return outcome, errors

    def _land(self, futures: dict[str, asyncio.Future[_Result]], task: asyncio.Task) -> None:
        results = {} if task.cancelled() or task.exception() is not None else task.result()
        for item_id, fut in futures.items():
            if self._flights.get(item_id) is fut:
                del self._flights[item_id]
            if not fut.done():
                fut.set_result(results.get(item_id, (None, None)))
