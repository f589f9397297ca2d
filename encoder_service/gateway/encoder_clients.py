"""Encoders behind one small interface, and the router that spreads items over them.

`EncoderClient.encode(items, request_id)` makes the items' embeddings available to decode
instances and returns `{item_id: info}` to forward as `ec_transfer_params`; it raises
EncoderFailed on any error or deadline; items it leaves out of the answer failed alone (bad
media for that encoder) and go raw. A client may also be `Releasing` (have
`release(item_ids)`): called once the decode instance is done with the items (first token,
or the request's end).
`VllmEncoderClient` talks to a vLLM ec_producer over HTTP; `PoolEncoderClient` to the
batching encoder pool (`epd encoder`: `/v1/encode`, `/v1/release`).

`EncoderRouter.encode` groups a request's items per encoder (one call per encoder,
least-loaded first), retries a failed group once on another encoder, and reports the items
that still failed: the caller sends those as raw media (local encode on the decode side).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import httpx

from ec_connectors.protocol.params import PARAMS_KEY
from encoder_service.gateway.parsing import MediaPart


class EncoderFailed(Exception):
    """An encode call failed or missed its deadline (message: what and where)."""


class EncoderClient(Protocol):
    name: str

    async def encode(self, items: Sequence[MediaPart], request_id: str) -> dict[str, Any]: ...


@runtime_checkable
class Releasing(Protocol):
    """An EncoderClient that holds items until told the decode side has them."""

    async def release(self, item_ids: Sequence[str]) -> None: ...


async def _post(name: str, client: httpx.AsyncClient, url: str, body: dict[str, Any],
                request_id: str, timeout_s: float, answer_s: float) -> httpx.Response:
    """POST with a deadline; every failure (timeout, connection, non-200) is EncoderFailed."""
    try:
        r = await asyncio.wait_for(
            client.post(url, json=body, headers={"x-request-id": request_id}), answer_s)
    except asyncio.TimeoutError:
        raise EncoderFailed(f"{name}: no answer within {timeout_s} s") from None
    except httpx.HTTPError as exc:
        raise EncoderFailed(f"{name}: {type(exc).__name__}: {exc}") from None
    if r.status_code != 200:
        raise EncoderFailed(f"{name}: HTTP {r.status_code}: {r.text[:200]}")
    return r


class VllmEncoderClient:
    """A vLLM server with an ec_producer EPDConnector (or any EC producer). One chat request
    carries all of a group's items; max_tokens=1 (an encoder-only producer makes none)."""

    def __init__(self, url: str, model: str, client: httpx.AsyncClient,
                 timeout_s: float) -> None:
        self.name = url
        self.url = url + "/v1/chat/completions"
        self.model = model
        self.client = client
        self.timeout_s = timeout_s

    async def encode(self, items: Sequence[MediaPart], request_id: str) -> dict[str, Any]:
        content = [*(it.part for it in items), {"type": "text", "text": "."}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": 1, "temperature": 0.0}
        body.update(items[0].kwargs)  # one request's items: the same processor settings
        r = await _post(self.name, self.client, self.url, body, request_id, self.timeout_s,
                        self.timeout_s)
        try:
            params = r.json().get("ec_transfer_params") or {}
            made = dict((params.get(PARAMS_KEY) or {}).get("items") or {})
        except (ValueError, AttributeError, TypeError):
            raise EncoderFailed(f"{self.name}: unreadable answer") from None
        # Items the producer did not list were already stored (its dedupe): still hinted.
        return {it.item_id: made.get(it.item_id, {}) for it in items}


def _payload(item: MediaPart) -> str:
    """The media of a prepared part as the pool takes it: a data: URL or base64."""
    part = item.part
    if part.get("type") == "input_audio":
        return part["input_audio"]["data"]
    return part[part["type"]]["url"]


class PoolEncoderClient:
    """The batching encoder pool (`epd encoder`): `POST /v1/encode` with all of a group's
    images (one request; the pool batches across requests). Items the pool reports as
    failed are left out of the answer (the caller sends them raw); so are modalities the pool
    does not serve. `release()` tells the pool the decode side has prefilled the items."""

    modalities = ("image", "video", "audio")  # what `epd encoder` can serve; its model decides

    def __init__(self, url: str, client: httpx.AsyncClient, timeout_s: float) -> None:
        self.name = url
        self.url = url
        self.client = client
        self.timeout_s = timeout_s

    async def encode(self, items: Sequence[MediaPart], request_id: str) -> dict[str, Any]:
        # the pool applies its own processor settings: items with others go raw
        todo = [it for it in items if it.modality in self.modalities and not it.kwargs]
        if not todo:
            return {}
        body = {"items": [{"id": it.item_id, "modality": it.modality, "data": _payload(it)}
                          for it in todo],
                "timeout_s": self.timeout_s, "on_failure": "text_only"}
        # the pool enforces timeout_s per item itself; the extra second is for the reply
        r = await _post(self.name, self.client, self.url + "/v1/encode", body, request_id,
                        self.timeout_s, self.timeout_s + 1.0)
        try:
            answer = r.json()
            made = dict((answer["ec_transfer_params"][PARAMS_KEY] or {}).get("items") or {})
            status = {k: v.get("status") for k, v in answer["items"].items()}
        except (ValueError, KeyError, AttributeError, TypeError):
            raise EncoderFailed(f"{self.name}: unreadable answer") from None
        return {it.item_id: made[it.item_id] for it in todo
                if status.get(it.item_id) == "ok" and isinstance(made.get(it.item_id), dict)}

    async def release(self, item_ids: Sequence[str]) -> None:
        """Best effort: a lost release only leaves the feature to the pool's LRU eviction."""
        with contextlib.suppress(asyncio.TimeoutError, httpx.HTTPError):
            await asyncio.wait_for(self.client.post(self.url + "/v1/release",
                                                    json={"item_ids": list(item_ids)}),
                                   self.timeout_s)


@dataclass
class EncodeOutcome:
    hints: dict[str, Any] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    retries: int = 0
    calls: int = 0
    # (client, item ids it encoded) for clients that want `release` once the decode is done
    holders: list[tuple[Releasing, list[str]]] = field(default_factory=list)

    async def release(self) -> None:
        """Tell every holding encoder the decode side is done (once; never raises)."""
        holders, self.holders = self.holders, []
        if holders:
            await asyncio.gather(*(c.release(ids) for c, ids in holders),
                                 return_exceptions=True)


class EncoderRouter:
    """Least-loaded dispatch with a cool-down for encoders that just failed."""

    def __init__(self, clients: Sequence[EncoderClient], cooldown_s: float = 5.0) -> None:
        self.clients = list(clients)
        self.cooldown_s = cooldown_s
        self.inflight = {c.name: 0 for c in self.clients}
        self.down_until = {c.name: 0.0 for c in self.clients}
        self._rr = itertools.count()

    def candidates(self, exclude: set[str] = frozenset()) -> list[EncoderClient]:
        """Usable encoders, least-loaded first (ties rotate). If all are cooling down, they
        are all tried anyway rather than none."""
        now = time.monotonic()
        pool = [c for c in self.clients if c.name not in exclude]
        up = [c for c in pool if self.down_until[c.name] <= now] or pool
        start = next(self._rr)
        order = {c.name: (i - start) % max(len(up), 1) for i, c in enumerate(up)}
        return sorted(up, key=lambda c: (self.inflight[c.name], order[c.name]))

    async def _call(self, client: EncoderClient, items: Sequence[MediaPart],
                    request_id: str) -> dict[str, Any]:
        self.inflight[client.name] += 1
        try:
            out = await client.encode(items, request_id)
        except EncoderFailed:
            self.down_until[client.name] = time.monotonic() + self.cooldown_s
            raise
        finally:
            self.inflight[client.name] -= 1
        self.down_until[client.name] = 0.0
        return out

    async def _group(self, first: EncoderClient, items: Sequence[MediaPart], request_id: str,
                     outcome: EncodeOutcome, errors: list[str]) -> None:
        tried = {first.name}
        client: EncoderClient | None = first
        for attempt in range(2):
            assert client is not None
            outcome.calls += 1
            try:
                made = await self._call(client, items, f"{request_id}-enc{attempt}")
            except EncoderFailed as exc:
                errors.append(str(exc))
            else:
                done = [it.item_id for it in items if it.item_id in made]
                outcome.hints.update((i, made[i]) for i in done)
                if len(done) < len(items):  # failed alone (bad for this encoder): raw
                    missing = [it.item_id for it in items if it.item_id not in made]
                    outcome.failed.extend(missing)
                    errors.append(f"{client.name}: {len(missing)} item(s) not encoded")
                if done and isinstance(client, Releasing):
                    outcome.holders.append((client, done))
                return
            others = self.candidates(exclude=tried)
            if attempt == 0 and others:
                outcome.retries += 1
                client = others[0]
                tried.add(client.name)
            else:
                break
        outcome.failed.extend(it.item_id for it in items)

    async def encode(self, items: Sequence[MediaPart], request_id: str
                     ) -> tuple[EncodeOutcome, list[str]]:
        """Encode `items`; returns the outcome and the error messages seen."""
        outcome, errors = EncodeOutcome(), []
        if not items:
            return outcome, errors
        if not self.clients:
            outcome.failed = [it.item_id for it in items]
            return outcome, ["no encoders configured"]
        targets = self.candidates()[: len(items)]
        groups = [items[i::len(targets)] for i in range(len(targets))]
        await asyncio.gather(*(self._group(t, g, request_id, outcome, errors)
                               for t, g in zip(targets, groups, strict=True)))
        return outcome, errors
