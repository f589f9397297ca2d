"""Encoders behind one small interface, and the router that spreads items over them.

`EncoderClient.encode(items, request_id)` makes the items' embeddings available to decode
instances and returns `{item_id: info}` to forward as `ec_transfer_params`; it raises
EncoderFailed on any error or deadline. `VllmEncoderClient` talks to a vLLM ec_producer over
HTTP; the encoder pool and Mooncake transports plug in as further clients.

`EncoderRouter.encode` groups a request's items per encoder (one call per encoder,
least-loaded first), retries a failed group once on another encoder, and reports the items
that still failed: the caller sends those as raw media (local encode on the decode side).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from encoder_service.gateway.parsing import MediaItem
from scheduler_hooks.params import PARAMS_KEY


class EncoderFailed(Exception):
    """An encode call failed or missed its deadline (message: what and where)."""


class EncoderClient(Protocol):
    name: str

    async def encode(self, items: Sequence[MediaItem], request_id: str) -> dict[str, Any]: ...


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

    async def encode(self, items: Sequence[MediaItem], request_id: str) -> dict[str, Any]:
        content = [*(it.part for it in items), {"type": "text", "text": "."}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": 1, "temperature": 0.0}
        try:
            r = await asyncio.wait_for(
                self.client.post(self.url, json=body, headers={"x-request-id": request_id}),
                self.timeout_s)
        except asyncio.TimeoutError:
            raise EncoderFailed(f"{self.name}: no answer within {self.timeout_s} s") from None
        except httpx.HTTPError as exc:
            raise EncoderFailed(f"{self.name}: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise EncoderFailed(f"{self.name}: HTTP {r.status_code}: {r.text[:200]}")
        try:
            params = r.json().get("ec_transfer_params") or {}
            made = dict((params.get(PARAMS_KEY) or {}).get("items") or {})
        except (ValueError, AttributeError, TypeError):
            raise EncoderFailed(f"{self.name}: unreadable answer") from None
        # Items the producer did not list were already stored (its dedupe): still hinted.
        return {it.item_id: made.get(it.item_id, {}) for it in items}


@dataclass
class EncodeOutcome:
    hints: dict[str, Any] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    retries: int = 0
    calls: int = 0


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

    async def _call(self, client: EncoderClient, items: Sequence[MediaItem],
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

    async def _group(self, first: EncoderClient, items: Sequence[MediaItem], request_id: str,
                     outcome: EncodeOutcome, errors: list[str]) -> None:
        tried = {first.name}
        client: EncoderClient | None = first
        for attempt in range(2):
            assert client is not None
            outcome.calls += 1
            try:
                outcome.hints.update(await self._call(client, items,
                                                      f"{request_id}-enc{attempt}"))
                return
            except EncoderFailed as exc:
                errors.append(str(exc))
            others = self.candidates(exclude=tried)
            if attempt == 0 and others:
                outcome.retries += 1
                client = others[0]
                tried.add(client.name)
            else:
                break
        outcome.failed.extend(it.item_id for it in items)

    async def encode(self, items: Sequence[MediaItem], request_id: str
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
